"""run_isolated: a case measured in a fresh child process, and every way a case can fail."""
import os
import time

import pytest
import torch

import benchlib.measure.case_child as case_child
import benchlib.measure.isolation as isolation
from benchlib.measure import (DEFAULT_MALLOC_POLICY, MALLOC_POLICIES, CaseFailed, IsolationOptions,
                              MemoryRequirementError, run_isolated)
from isolation_targets import ARRAY_BYTES

pytestmark = pytest.mark.slow


def test_child_returns_measurement_checks_and_environment():
    result = run_isolated("isolation_targets:allocate", {"n": ARRAY_BYTES // 8}, name="allocate",
                          options=IsolationOptions(track_allocations=True, repeats=2))
    m = result.measurement
    assert result.name == m.name == "allocate" and m.device == "cpu"
    assert len(m.times_s) == 2
    assert m.alloc_bytes >= ARRAY_BYTES and m.alloc_source == "memray"
    # the array made during set-up is below the baseline; the one made per call is above it
    assert ARRAY_BYTES * 0.9 <= m.peak_bytes < 2 * ARRAY_BYTES
    assert result.checks == {"sum": float(ARRAY_BYTES // 8), "kept": float(ARRAY_BYTES // 8)}
    phases = list(dict.fromkeys(m.timeline["phase"]))
    assert phases[:3] == ["", "allocate", "reduce"]
    assert m.timeline.loc[m.timeline["phase"] == "reduce", "bytes"].max() >= ARRAY_BYTES * 0.9
    env = result.environment
    assert env["pid"] != os.getpid()
    assert env["malloc_policy"] == DEFAULT_MALLOC_POLICY == "mmap-128k"
    assert env["malloc_env"] == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    assert env["device"]["device"] == "cpu" and "torch_threads" in env


def test_a_trial_says_where_its_time_went_phase_by_phase():
    started = time.perf_counter()
    result = run_isolated("isolation_targets:with_roles", {"n": 1000}, name="roles",
                          options=IsolationOptions(track_allocations=True, role_timeline=True, timeline=False))
    wall = time.perf_counter() - started
    phases = result.measurement.phase_s
    assert list(phases) == ["setup", "warmup", "timed", "allocation_pass", "check", "role_pass", "process"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= wall  # the phases partition the call: none is counted twice
    plain = run_isolated("isolation_targets:allocate", {"n": 10}, name="plain", options=IsolationOptions(timeline=False))
    assert set(plain.measurement.phase_s) == {"setup", "warmup", "timed", "check", "process"}


def test_a_role_timeline_is_one_more_call_read_with_the_cases_gauge_only_when_asked():
    n = 1_000_000
    result = run_isolated("isolation_targets:with_roles", {"n": n}, name="roles",
                          options=IsolationOptions(role_timeline=True, timeline_interval_s=0.005))
    roles = result.role_timeline
    assert list(roles.columns) == ["t_s", "bytes", "phase", "array"]
    assert roles["array"].iloc[0] == 0 and roles["array"].iloc[-1] == 0 and roles["array"].max() == 8 * n
    assert result.measurement.timeline is not None and "array" not in result.measurement.timeline
    assert run_isolated("isolation_targets:with_roles", {"n": n}, name="roles").role_timeline is None
    assert run_isolated("isolation_targets:allocate", {"n": 10}, name="no gauge",
                        options=IsolationOptions(role_timeline=True)).role_timeline is None


def test_a_role_context_with_metrics_adds_them_to_the_checks_of_the_child_that_took_the_role_timeline():
    # torch's saved bytes come from the role timeline's call: not one more call in every trial's check
    with_roles = run_isolated("isolation_targets:with_role_metrics", name="roles",
                              options=IsolationOptions(role_timeline=True, timeline=False))
    assert with_roles.checks == {"checked": 1.0, "watched_calls": 1.0}
    assert run_isolated("isolation_targets:with_role_metrics", name="roles",
                        options=IsolationOptions(timeline=False)).checks == {"checked": 1.0}


def test_a_passive_gauge_rides_on_a_single_measured_call_and_any_other_gets_one_more_call():
    n = 1_000_000
    folded = run_isolated("isolation_targets:with_passive_roles", {"n": n}, name="roles",
                          options=IsolationOptions(role_timeline=True, timeline_interval_s=0.005))
    # the check runs before any extra call: one call means the role timeline is the measured call's own
    assert folded.checks == {"calls": 1.0, "watched_calls": 1.0}
    assert "role_pass" not in folded.measurement.phase_s
    assert folded.role_timeline["array"].max() == 8 * n
    assert folded.role_timeline[["t_s", "bytes"]].equals(folded.measurement.timeline[["t_s", "bytes"]])
    two_calls = run_isolated("isolation_targets:with_passive_roles", {"n": n}, name="roles",
                             options=IsolationOptions(role_timeline=True, repeats=2, timeline_interval_s=0.005))
    assert two_calls.checks == {"calls": 2.0, "watched_calls": 1.0} and "role_pass" in two_calls.measurement.phase_s
    assert two_calls.role_timeline["array"].max() == 8 * n and "array" not in two_calls.measurement.timeline
    hooked = run_isolated("isolation_targets:with_roles", {"n": n}, name="roles",
                          options=IsolationOptions(role_timeline=True, timeline_interval_s=0.005))
    assert "role_pass" in hooked.measurement.phase_s  # a gauge not marked passive never rides on a measured call


@pytest.mark.parametrize("policy, expected", [("mmap-128k", 131072.0), ("glibc-default", -1.0)])
def test_malloc_policy_reaches_the_child(policy, expected, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    result = run_isolated("isolation_targets:environment", name="env",
                          options=IsolationOptions(malloc=policy, timeline=False))
    assert result.checks["mmap_threshold"] == expected
    assert result.environment["malloc_env"] == MALLOC_POLICIES[policy]


def test_exception_in_measured_function_comes_back_with_traceback():
    with pytest.raises(CaseFailed) as info:
        run_isolated("isolation_targets:raises", name="raiser")
    message = str(info.value)
    assert info.value.name == "raiser" and "case 'raiser' failed" in message
    assert "ValueError: deliberate failure in the measured function" in message
    assert "Traceback (most recent call last)" in message and "isolation_targets.py" in message


def test_exception_in_setup_comes_back_with_traceback():
    with pytest.raises(CaseFailed, match="RuntimeError: set-up broke") as info:
        run_isolated("isolation_targets:fails_in_setup", {"message": "set-up broke"},
                     name="setup")
    assert "fails_in_setup" in info.value.child_traceback


def test_target_that_returns_no_case_is_explained():
    with pytest.raises(CaseFailed, match=r"must return benchlib.measure.Case"):
        run_isolated("isolation_targets:not_a_case", name="plain")


def test_hard_exit_is_a_crash_and_the_caller_carries_on():
    with pytest.raises(CaseFailed, match="exited with status 3 without writing a result"):
        run_isolated("isolation_targets:exits_hard", {"status": 3}, name="exit")
    assert run_isolated("isolation_targets:environment", name="next",
                        options=IsolationOptions(timeline=False)).checks["pid"] > 0


def test_thread_left_running_does_not_turn_a_result_into_a_timeout():
    result = run_isolated("isolation_targets:leaves_thread_running", name="threads",
                          options=IsolationOptions(timeline=False, timeout_s=60))
    assert result.checks == {"result": 1.0}


def test_abort_names_the_signal():
    with pytest.raises(CaseFailed, match="killed by SIGABRT") as info:
        run_isolated("isolation_targets:aborts", name="abort")
    assert info.value.name == "abort"


def test_timeout_kills_the_child():
    with pytest.raises(CaseFailed, match=r"case 'sleepy' failed: timed out after 1\.5 s"):
        run_isolated("isolation_targets:sleeps", {"seconds": 60}, name="sleepy",
                     options=IsolationOptions(timeout_s=1.5))


def test_memory_precheck_refuses_before_spawning(monkeypatch):
    def no_spawn(*args, **kwargs):
        raise AssertionError("a refused case must not start a process")

    monkeypatch.setattr(isolation.subprocess, "Popen", no_spawn)
    with pytest.raises(MemoryRequirementError) as info:
        run_isolated("isolation_targets:allocate", name="huge",
                     options=IsolationOptions(memory_required_bytes=10**18))
    err = info.value
    assert isinstance(err, CaseFailed) and err.name == "huge"
    assert err.required_bytes == 10**18 and 0 < err.available_bytes < 10**18
    assert f"{10**18:,} bytes" in str(err) and f"{err.available_bytes:,} bytes" in str(err)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(malloc="jemalloc"), ValueError, "valid policies: 'mmap-128k', 'mmap-64k', 'glibc-default', 'training-process'"),
    (dict(target="no_colon"), ValueError, "'module:function'"),
    (dict(params={"x": object()}), ValueError, "must be JSON values"),
    (dict(params={"x": float("nan")}), ValueError, "must be JSON values"),
    (dict(timeout_s=0), ValueError, "timeout_s must be a positive"),
    (dict(repeats=0), ValueError, "repeats must be"),
    (dict(device="tpu"), ValueError, "valid forms"),
    (dict(name=""), ValueError, "name must be a non-empty string"),
    (dict(timeline_interval_s=0), ValueError, "timeline_interval_s must be a positive"),
    (dict(memory_required_bytes=-1), ValueError, "memory_required_bytes must be"),
    (dict(params=[1, 2]), TypeError, "params must be a dict"),
])
def test_bad_arguments_are_refused_before_spawning(kwargs, error, message, monkeypatch):
    monkeypatch.setattr(isolation.subprocess, "Popen", None)
    call = {"target": "isolation_targets:allocate", "name": "bad", **kwargs}
    option_names = IsolationOptions.__dataclass_fields__
    options = {key: call.pop(key) for key in list(call) if key in option_names}
    with pytest.raises(error, match=message):
        run_isolated(call.pop("target"), call.pop("params", None), options=IsolationOptions(**options), **call)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.cuda
def test_cuda_child_measures_on_the_gpu():
    result = run_isolated("isolation_targets:cuda_allocate", {"n": 1_000_000}, name="gpu",
                          device="cuda", options=IsolationOptions(track_allocations=True))
    m = result.measurement
    assert m.device.startswith("cuda:") and m.alloc_count == 1 and m.peak_bytes >= 4_000_000
    assert m.alloc_source == "cuda-caching-allocator"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.cuda
def test_cuda_first_call_peak_leaves_out_the_cublas_workspaces():
    """warmup=0: the first measured product and its gradient; cuBLAS's workspaces (32 MiB a thread on an
    H100) were made at the child's set-up, so the peak holds the 64 x 64 float32 buffers alone."""
    result = run_isolated("isolation_targets:cuda_matmul_gradient", {"n": 64}, name="first-product",
                          device="cuda", options=IsolationOptions(warmup=0))
    assert 0 < result.measurement.peak_bytes < 1_000_000


def test_the_child_primes_cuda_before_the_case_is_set_up(tmp_path, monkeypatch):
    """Without a GPU: for a CUDA device, child_main primes the CUDA libraries first, then sets the case up."""
    import json

    events = []
    monkeypatch.setattr(case_child, "resolve_device", lambda spec: case_child.Device("cuda", 0))
    monkeypatch.setattr(case_child, "prime_cuda_libraries", lambda device: events.append(("prime", device.name)))

    def load_case(target, device, params):
        events.append(("set-up", target))
        raise RuntimeError("stop before measuring")

    monkeypatch.setattr(case_child, "_load_case", load_case)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"parent_pid": os.getppid(), "sys_path": [], "device": "cuda:0",
                                "target": "isolation_targets:cuda_allocate", "params": {}}))
    monkeypatch.setattr(case_child, "die_with_parent", lambda pid: None)
    assert case_child.child_main(str(spec), str(tmp_path / "result.json")) == 1
    assert events == [("prime", "cuda:0"), ("set-up", "isolation_targets:cuda_allocate")]
    assert "stop before measuring" in json.loads((tmp_path / "result.json").read_text())["error"]


def test_priming_cuda_does_nothing_on_the_cpu(monkeypatch):
    from benchlib.measure.devices import prime_cuda_libraries

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("touched CUDA"))
    prime_cuda_libraries(isolation.Device("cpu"))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_timeout_also_kills_what_the_child_started(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    monkeypatch.setenv("GRANDCHILD_PID_FILE", str(pid_file))
    # A busy machine can take longer than the timeout to start the child; then there is no
    # grandchild to check yet, so try again with more time.
    for timeout_s in (3, 15, 60):
        with pytest.raises(CaseFailed, match="timed out"):
            run_isolated("isolation_targets:spawns_sleeper", name="tree",
                         options=IsolationOptions(timeout_s=timeout_s))
        if pid_file.exists() and pid_file.read_text():
            break
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # reaped by init shortly after the kill
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} still running after the timeout")


def test_a_child_past_its_resident_cap_ends_itself_and_says_what_it_held():
    from benchlib.measure import CaseCapped

    cap = 300 * 10 ** 6
    with pytest.raises(CaseCapped) as capped:  # 800 MB asked: the process ends near the cap, not at 800 MB
        run_isolated("isolation_targets:allocate", {"n": 100_000_000}, name="big",
                     options=IsolationOptions(timeline=False, rss_cap_bytes=cap))
    assert cap < capped.value.resident < 800 * 10 ** 6 and capped.value.cap == cap
    assert "passed the 0.3 GB cap" in str(capped.value)
    small = run_isolated("isolation_targets:allocate", {"n": 1000}, name="small",
                         options=IsolationOptions(timeline=False, rss_cap_bytes=cap))
    assert small.measurement.peak_bytes is not None  # under its cap: measured as ever
    with pytest.raises(ValueError, match="rss_cap_bytes must be a number of bytes > 0"):
        IsolationOptions(rss_cap_bytes=-1)


def test_the_resident_cap_judges_the_measured_steps_not_the_check_after_them():
    cap = 300 * 10 ** 6  # the check holds 800 MB: over the cap, after the steps it judges
    result = run_isolated("isolation_targets:allocate_in_check", {"n": 100_000_000}, name="checked",
                          options=IsolationOptions(timeline=False, rss_cap_bytes=cap))
    assert result.checks["checked"] == 100_000_000 and result.measurement.peak_bytes < cap
