"""benchlib's pytest plugin in a user's own test suite (a temporary project run in a fresh pytest
process, the plugin found through its `pytest11` entry point): the lean model passes, a wasteful
version of it fails under two engines, and limits or engines that cannot be checked never pass."""

import textwrap
from importlib.metadata import entry_points

import pytest

LEAN = textwrap.dedent('''
    import torch
    from torch import nn

    NAME = "mlp"
    PARAMETERS = {"width": 64, "n": 32}


    def model(width, n):
        return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


    def batch(width, n):
        return torch.randn(n, 16), torch.randn(n, 1)


    def loss(model, x, y):
        return ((model(x) - y) ** 2).mean()
''')
# The same model, its loss fed four copies of the batch: four times the saved activations.
WASTEFUL = LEAN.replace("    return ((model(x)", "    x, y = x.repeat(4, 1), y.repeat(4, 1)\n    return ((model(x)")

TESTS = textwrap.dedent('''
    import pytest


    @pytest.mark.limit_gradient_step(growth="1.2x")
    @pytest.mark.parametrize("engine", ["torch", "torch.func"])
    def test_step_stays_lean(gradient_step, engine):
        gradient_step("mlp.py", engine)
''')


def test_the_plugin_is_registered_for_every_test_suite():
    assert "benchlib.pytest_plugin" in {entry.value for entry in entry_points(group="pytest11")}


@pytest.mark.slow
def test_a_suite_without_the_marker_imports_neither_the_gate_nor_torch(pytester):
    # the plugin is installed in every suite of the environment: it must cost them nothing
    pytester.makepyfile(test_plain=textwrap.dedent('''
        import sys

        def test_plain():
            assert "benchlib.usermodel.gate" not in sys.modules and "torch" not in sys.modules
    '''))
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.slow
def test_a_users_suite_fails_the_wasteful_version_under_two_engines(pytester):
    pytester.makepyfile(mlp=LEAN, test_memory=TESTS)
    saved = pytester.runpytest_subprocess("--benchlib-save-baselines")
    saved.assert_outcomes(passed=2)
    assert len(list((pytester.path / ".benchlib-baselines").glob("*.json"))) == 2
    pytester.runpytest_subprocess().assert_outcomes(passed=2)  # the lean model against its own baseline

    (pytester.path / "mlp.py").write_text(WASTEFUL)
    wasteful = pytester.runpytest_subprocess()
    wasteful.assert_outcomes(failed=2)
    output = wasteful.stdout.str()
    assert "mlp under torch: peak grew" in output and "mlp under torch.func: peak grew" in output
    assert "saved activations grew the most" in output  # torch's roles include the saved activations
    assert "your line holding most: mlp.py:" in output


@pytest.mark.slow
def test_absolute_limits_and_what_cannot_be_checked(pytester):
    pytester.makepyfile(mlp=LEAN, test_limits=textwrap.dedent('''
        def test_peak_within(gradient_step):
            gradient_step("mlp.py", "torch", peak="64 MiB", allocations=100_000)

        def test_peak_over(gradient_step):
            gradient_step("mlp.py", "torch", params={"n": 256}, peak="10 kB")

        def test_engine_that_does_not_apply(gradient_step):
            gradient_step("mlp.py", "fused-optimizer")

        def test_growth_without_baseline(gradient_step):
            gradient_step("mlp.py", "torch", growth="1.1x")
    '''))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    output = result.stdout.str()
    assert "mlp under torch: peak" in output and "exceeds the limit 10.00 kB" in output
    assert "fused-optimizer does not apply to" in output
    assert "no baseline at these values" in output


@pytest.mark.slow
def test_a_limit_that_does_not_parse_is_a_usage_error(pytester):
    pytester.makepyfile(test_bad=textwrap.dedent('''
        import pytest

        @pytest.mark.limit_gradient_step(peak="lots")
        def test_anything(gradient_step):
            gradient_step("mlp.py")
    '''))
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "'lots' is not a memory size; valid:" in result.stderr.str()


@pytest.mark.slow
def test_a_device_that_is_not_here_is_a_usage_error(pytester):
    pytester.makepyfile(test_any="def test_any(gradient_step):\n    pass\n")
    result = pytester.runpytest_subprocess("--benchlib-device", "gpu7")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--benchlib-device gpu7: malformed device 'gpu7'; valid forms:" in result.stderr.str()


@pytest.mark.slow
def test_an_infinite_limit_is_a_usage_error_not_an_internal_error(pytester):
    pytester.makepyfile(test_bad=textwrap.dedent('''
        import pytest

        @pytest.mark.limit_gradient_step(peak="1e999 GB")
        def test_anything(gradient_step):
            pass
    '''))
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*is not a finite memory size*"])


@pytest.mark.slow
def test_a_marker_whose_test_measures_no_step_never_passes(pytester):
    pytester.makepyfile(test_unchecked=textwrap.dedent('''
        import pytest

        @pytest.mark.limit_gradient_step(peak="1 B")
        def test_forgot_the_fixture():
            pass
    '''))
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*this test does not use it: nothing would be checked*"])
    pytester.makepyfile(test_unchecked=textwrap.dedent('''
        import pytest

        @pytest.mark.limit_gradient_step(peak="1 B")
        def test_never_called(gradient_step):
            pass
    '''))
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*never called gradient_step(...): nothing was checked*"])
