"""Models by name (`benchlib.usermodel.named`): hf: configs committed as test data (GPT-2-, Llama- and BERT-shaped,
two layers each) written as model files that pass the form's check under every task, dtype and optimizer; refusals
before any work (a library missing, an unknown name, no config offline); tv: and timm: names written from stand-in
libraries (this machine's package sources hold no torchvision built for its CPU torch); `benchlib new --from`; and a
name run and fitted end to end as its file is."""

import ast
import sys
import types
from pathlib import Path

import pytest

from benchlib.runner.cli import main
from benchlib.usermodel import named
from benchlib.usermodel.loader import check_form, read_model_file
from benchlib.usermodel.named import NamedModelError, is_model_name, model_file_text, named_model_file

DATA = Path(__file__).resolve().parent / "data" / "hf"
GPT2_124M = Path(__file__).resolve().parents[1] / "results" / "reference" / "cuda-truth" / "gpt2_124m"


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch):
    """Names written under the test's own folder, and never a request to the Hub."""
    monkeypatch.setenv("BENCHLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_name_is_a_known_prefix_and_something_after_it_and_never_an_existing_file(tmp_path, monkeypatch):
    assert is_model_name("hf:gpt2") and is_model_name("tv:resnet18") and is_model_name("timm:vit_tiny_patch16_224")
    assert not is_model_name("hf:") and not is_model_name("model.py") and not is_model_name("xx:foo")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf:odd").write_text("")
    assert not is_model_name("hf:odd")  # a file of that very name is that file


@pytest.mark.parametrize("folder, task, seq_len", [("gpt2_tiny", "causal-lm", 128), ("llama_tiny", "causal-lm", 2048),
                                                   ("bert_tiny", "masked-lm", 128)])
def test_an_hf_config_is_written_as_a_model_file_whose_defaults_come_from_the_config(folder, task, seq_len):
    path = named_model_file(f"hf:{DATA / folder}")
    model_file = read_model_file(path)
    assert model_file.name == f"hf_{folder}"
    assert model_file.parameters == {"batch_size": 8, "seq_len": seq_len, "task": task, "dtype": "float32",
                                     "optimizer": "adamw"}  # the llama's 4096 positions capped at 2048
    assert model_file.quick == {"batch_size": 1, "seq_len": 32}
    assert "transformers_version" not in path.read_text()
    assert named_model_file(f"hf:{DATA / folder}") == path  # the same name: the same file, not written again


@pytest.mark.parametrize("folder, changed", [
    ("gpt2_tiny", {"optimizer": "sgd"}), ("llama_tiny", {"optimizer": "adafactor", "task": "seq-cls"}),
    ("bert_tiny", {"task": "seq-cls"}), ("bert_tiny", {"dtype": "bfloat16"})])
def test_the_written_file_passes_the_forms_check_under_each_task_dtype_and_optimizer(folder, changed):
    import torch

    model_file = read_model_file(named_model_file(f"hf:{DATA / folder}"))
    values = {**model_file.parameters, **model_file.quick, **changed}
    check_form(model_file, values)  # model, batch, loss and the optimizer built and stepped once
    model, batch = model_file.build(values)
    kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}[values["optimizer"]]
    assert isinstance(model_file.optimizer_at(values)(model.parameters()), kind)
    assert next(model.parameters()).dtype == getattr(torch, values["dtype"])
    assert len(batch) == (2 if values["task"] == "seq-cls" else 1)


def test_a_bad_task_or_dtype_names_the_valid_ones():
    model_file = read_model_file(named_model_file(f"hf:{DATA / 'gpt2_tiny'}"))
    with pytest.raises(ValueError, match=r"task='chat': valid values are \('causal-lm', 'masked-lm', 'seq-cls'\)"):
        model_file.build({**model_file.parameters, "task": "chat"})
    with pytest.raises(ValueError, match="dtype='int8': valid values are"):
        model_file.build({**model_file.parameters, "dtype": "int8"})


def test_a_config_json_path_and_its_directory_are_one_model(tmp_path):
    by_file = model_file_text(f"hf:{DATA / 'bert_tiny' / 'config.json'}")
    by_folder = model_file_text(f"hf:{DATA / 'bert_tiny'}")
    assert 'NAME = "hf_bert_tiny"' in by_file and 'NAME = "hf_bert_tiny"' in by_folder
    assert by_file.split("CONFIG = ")[1] == by_folder.split("CONFIG = ")[1]


def test_names_are_refused_before_any_work_saying_what_would_do(tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "lama"}')
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_text("{")
    for name, words in [
        ("hf:no/such/dir/config.json", "no such directory or config.json"),
        ("hf:someone/not-cached", "nor in the local Hugging Face cache, and HF_HUB_OFFLINE is set"),
        (f"hf:{broken}", "model_type 'lama' is not one this transformers knows; closest: llama"),
        (f"hf:{tmp_path / 'notjson'}", "is not a readable JSON config"),
        ("zz:thing", "is no model name; valid: hf:NAME_OR_PATH, tv:NAME or timm:NAME"),
    ]:
        with pytest.raises(NamedModelError, match=words.replace("(", r"\(").replace(")", r"\)")):
            model_file_text(name)
    real = named.importlib.util.find_spec
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda library: None if library == "transformers" else real(library))
    with pytest.raises(NamedModelError, match=r"hf: names need transformers, which is not installed; install "
                                              r"benchlib's extra: pip install 'benchlib\[hf\]'"):
        model_file_text(f"hf:{DATA / 'gpt2_tiny'}")


def _stand_in(monkeypatch, library: str, module: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, library, module)
    real = named.importlib.util.find_spec
    monkeypatch.setattr(named.importlib.util, "find_spec",
                        lambda name: object() if name == library else real(name))


def test_a_torchvision_name_is_written_with_its_own_image_size_or_refused_with_the_closest(monkeypatch):
    weights = types.SimpleNamespace(DEFAULT=types.SimpleNamespace(transforms=lambda: types.SimpleNamespace(crop_size=[299])))
    models = types.ModuleType("torchvision.models")
    models.list_models = lambda module=None: ["resnet18", "inception_v3"] + ([] if module else ["fasterrcnn_resnet50_fpn"])
    models.get_model_weights = lambda name: weights
    torchvision = types.ModuleType("torchvision")
    torchvision.models = models
    _stand_in(monkeypatch, "torchvision", torchvision)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    text = model_file_text("tv:inception_v3")
    module = ast.parse(text)
    assert 'NAME = "tv_inception_v3"' in text and '"image_size": 299' in text and "import torchvision" in text
    assert 'torchvision.models.get_model("inception_v3", weights=None, num_classes=num_classes)' in text
    assert {node.name for node in module.body if isinstance(node, ast.FunctionDef)} == {"model", "batch", "loss",
                                                                                       "optimizer"}
    with pytest.raises(NamedModelError, match="tv:resnet81 is no torchvision classification model; closest: resnet18"):
        model_file_text("tv:resnet81")
    with pytest.raises(NamedModelError, match="not an image classifier"):
        model_file_text("tv:fasterrcnn_resnet50_fpn")


def test_a_timm_name_is_written_with_its_input_size_and_a_failing_import_is_refused(monkeypatch):
    timm = types.ModuleType("timm")
    timm.list_models = lambda: ["vit_tiny_patch16_224", "resnet18"]
    timm.get_pretrained_cfg = lambda name: types.SimpleNamespace(input_size=(3, 224, 224))
    _stand_in(monkeypatch, "timm", timm)
    text = model_file_text("timm:vit_tiny_patch16_224")
    assert ast.parse(text) and 'NAME = "timm_vit_tiny_patch16_224"' in text and '"image_size": 224' in text
    assert '**({} if image_size == 224 else {"img_size": image_size})' in text
    with pytest.raises(NamedModelError, match="timm:vit_tiny_patch16_2244 is no timm model; closest: vit_tiny_patch16_224"):
        model_file_text("timm:vit_tiny_patch16_2244")
    monkeypatch.delitem(sys.modules, "timm")
    monkeypatch.setattr(named.importlib, "import_module", lambda name: (_ for _ in ()).throw(
        RuntimeError("operator torchvision::nms does not exist")))
    with pytest.raises(NamedModelError, match="timm is installed but cannot be imported here .RuntimeError: operator"):
        model_file_text("timm:resnet18")


def test_an_optimizer_may_take_the_files_parameters(tmp_path):
    import torch

    path = tmp_path / "lr.py"
    path.write_text("import torch\nPARAMETERS = {'width': 4, 'lr': 0.5}\n\ndef model(width, lr):\n"
                    "    return torch.nn.Linear(width, 1)\n\ndef batch(width, lr):\n    return (torch.ones(2, width),)\n\n"
                    "def loss(model, x):\n    return model(x).sum()\n\ndef optimizer(parameters, width, lr):\n"
                    "    return torch.optim.SGD(parameters, lr=lr)\n")
    model_file = read_model_file(path)
    check_form(model_file, model_file.parameters)
    made = model_file.optimizer_at({"width": 4, "lr": 0.25})(torch.nn.Linear(4, 1).parameters())
    assert made.param_groups[0]["lr"] == 0.25
    plain = tmp_path / "plain.py"
    plain.write_text(path.read_text().replace("def optimizer(parameters, width, lr)", "def optimizer(parameters)")
                     .replace("lr=lr", "lr=0.1"))
    assert read_model_file(plain).optimizer_at({"width": 4, "lr": 0.25})(torch.nn.Linear(4, 1).parameters()
                                                                         ).param_groups[0]["lr"] == 0.1


def test_new_from_a_name_writes_the_file_the_name_stands_for_and_never_overwrites(tmp_path, capsys):
    target = tmp_path / "my_gpt2.py"
    assert main(["new", str(target), "--from", f"hf:{DATA / 'gpt2_tiny'}"]) == 0
    assert target.read_text() == named_model_file(f"hf:{DATA / 'gpt2_tiny'}").read_text()
    assert main(["new", str(target), "--from", f"hf:{DATA / 'gpt2_tiny'}"]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert main(["new", str(tmp_path / "other.py"), "--from", f"hf:{DATA / 'gpt2_tiny'}", "--form", "arrays"]) == 2
    assert "writes a model file in the torch form" in capsys.readouterr().err
    assert main(["new", str(tmp_path / "x.py"), "--from", "hf:no/such/config.json"]) == 2
    assert not (tmp_path / "x.py").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes of work beside the suite's other workers
def test_a_name_runs_checked_gates_and_is_what_fit_asks_of(tmp_path):
    from benchlib.records.store import load_records, load_run_info

    name = f"hf:{DATA / 'bert_tiny'}"
    assert main(["run", name, "--quick", "-p", "engines=torch,torch-checkpoint", "-p", "trials=1",
                 "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = load_records(run_dir)
    assert set(records["benchmark"]) == {"hf_bert_tiny"}
    checked = records[records["metric"] == "grad_max_rel_err"]
    assert set(checked["variant"]) == {"torch-checkpoint"} and (checked["value"] < 1e-4).all()
    assert load_run_info(run_dir)["notebooks"]["hf_bert_tiny"]["status"] == "ok"

    from benchlib.usermodel.gate import measure_step

    gated = measure_step(name, "torch", quick=True, sites=False)  # the pytest gate's measurement, by name
    assert gated.name == "hf_bert_tiny" and gated.peak_bytes > 0 and gated.alloc_count > 0

    from benchlib.fit.asking import ask

    question = ask(name, "1GB", "batch_size", ["torch"], None, predicted=True)  # fit's question, asked of the name
    assert question.model_file.path == named_model_file(name) and question.values["seq_len"] == 128
