"""nmcompile.deploy.tensorrt: builder-log parsing and the deploy routes' errors (CPU), and a TensorRT build (GPU)."""

import contextlib
import importlib
import importlib.util
import logging
import sys
import types

import pytest
import torch
from torch import nn

from nmcompile.deploy import tensorrt as trt_route
from nmcompile.deploy.tensorrt import SparsityLog, compile_aot, onnx_session, parse_sparsity_log

TRTEXEC = """\
[03/23/2021-00:14:05] [I] [TRT] Some unrelated line: with, commas
[03/23/2021-00:14:05] [I] [TRT] (Sparsity) Layers eligible for sparse math: conv1, conv2, conv3
[03/23/2021-00:14:05] [I] [TRT] (Sparsity) TRT inference plan picked sparse implementation for layers: conv2, conv3
[03/23/2021-00:14:06] [I] [TRT] Engine built in 12.3 sec.
"""

TORCH_TRT = """\
DEBUG:torch_tensorrt [TensorRT Conversion Context]:Global timing cache in use.
INFO:torch_tensorrt [TensorRT Conversion Context]:(Sparsity) Layers eligible for sparse math: [MATRIX_MULTIPLY]-[aten_ops.addmm.default]-[fc1/addmm] + [RELU]-[aten_ops.relu.default]-[relu1], [MATRIX_MULTIPLY]-[aten_ops.addmm.default]-[fc2/addmm]
INFO:torch_tensorrt [TensorRT Conversion Context]:(Sparsity) TRT inference plan picked sparse implementation for layers: [MATRIX_MULTIPLY]-[aten_ops.addmm.default]-[fc2/addmm]
"""

SPLIT = """\
[TRT] [V] (Sparsity) Layers eligible for sparse math: a, b
[TRT] [V] (Sparsity) Layers eligible for sparse math: c,
    d ,e
[TRT] [V] (Sparsity) TRT inference plan picked sparse implementation for layers: b
[TRT] [V] (Sparsity) TRT inference plan picked sparse implementation for layers: e , b
[TRT] [V] tactic 0x0001 time 0.1
"""

NONE_PICKED = """\
[08/22/2026-10:12:13] [TRT] [I] (Sparsity) Layers eligible for sparse math: fc1, fc2
[08/22/2026-10:12:13] [TRT] [I] (Sparsity) TRT inference plan picked sparse implementation for layers: None
"""

NOTHING = """\
[I] (Sparsity) Layers eligible for sparse math:
[I] (Sparsity) TRT inference plan picked sparse implementation for layers:
[I] Engine built.
"""


def test_trtexec_log():
    log = parse_sparsity_log(TRTEXEC)
    assert log == SparsityLog(eligible=("conv1", "conv2", "conv3"), picked=("conv2", "conv3"))
    assert log.dense_eligible == ("conv1",)


def test_torch_tensorrt_layer_names_keep_brackets_and_fusions():
    log = parse_sparsity_log(TORCH_TRT)
    fc1 = "[MATRIX_MULTIPLY]-[aten_ops.addmm.default]-[fc1/addmm] + [RELU]-[aten_ops.relu.default]-[relu1]"
    fc2 = "[MATRIX_MULTIPLY]-[aten_ops.addmm.default]-[fc2/addmm]"
    assert log.eligible == (fc1, fc2)
    assert log.picked == (fc2,)
    assert log.dense_eligible == (fc1,)


def test_lines_accumulate_continue_after_comma_and_deduplicate():
    log = parse_sparsity_log(SPLIT)
    assert log.eligible == ("a", "b", "c", "d", "e")
    assert log.picked == ("b", "e")
    assert log.dense_eligible == ("a", "c", "d")


def test_none_and_empty_lists():
    log = parse_sparsity_log(NONE_PICKED)
    assert log == SparsityLog(eligible=("fc1", "fc2"), picked=())
    assert log.dense_eligible == ("fc1", "fc2")
    assert parse_sparsity_log(NOTHING) == SparsityLog()
    assert parse_sparsity_log("") == SparsityLog()


def test_ansi_colours_and_case():
    text = "\x1b[32m[I]\x1b[0m (sparsity) layers ELIGIBLE for sparse math: x\x1b[0m\n"
    assert parse_sparsity_log(text).eligible == ("x",)


def test_str_is_a_table():
    text = str(parse_sparsity_log(TRTEXEC))
    assert "2 of 3 eligible layers run sparse" in text
    rows = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()[3:]}
    assert rows == {"conv1": "dense (eligible, dense was faster)", "conv2": "sparse", "conv3": "sparse"}
    assert "no layer eligible" in str(SparsityLog())


# --- routes without TensorRT (this machine) ---------------------------------------------------


def test_compile_aot_without_torch_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)  # makes the import fail everywhere
    with pytest.raises(ImportError, match=r'pip install "nmcompile\[tensorrt\]"'):
        compile_aot(nn.Linear(8, 8), torch.randn(2, 8))


def test_compile_aot_rejects_mismatched_minor(monkeypatch):
    fake = types.ModuleType("torch_tensorrt")
    fake.__version__ = "2.0.1"
    monkeypatch.setitem(sys.modules, "torch_tensorrt", fake)
    with pytest.raises(ImportError, match="minor versions must be equal"):
        compile_aot(nn.Linear(8, 8), torch.randn(2, 8))


def test_cpu_model_is_refused():
    with pytest.raises(ValueError, match=r"model\.cuda\(\)"):
        trt_route._check_deployable(nn.Linear(8, 8), (torch.randn(2, 8),))


def test_enabled_precisions_only_where_the_signature_has_it():
    def old(exported, inputs=None, *, sparse_weights=False, enabled_precisions=None, workspace_size=0):
        pass

    def new(exported, inputs=None, *, sparse_weights=False, workspace_size=0, **kwargs):
        pass

    kw = trt_route._compile_kwargs(old, {torch.float16}, 1 << 30, {})
    assert kw == {"sparse_weights": True, "enabled_precisions": {torch.float16}, "workspace_size": 1 << 30}
    assert trt_route._compile_kwargs(new, {torch.float16}, None, {"min_block_size": 1}) == {
        "sparse_weights": True,
        "min_block_size": 1,
    }
    with pytest.raises(ValueError, match="precision follows the model"):
        trt_route._compile_kwargs(new, {torch.float16}, None, {"enabled_precisions": {torch.float16}})


def _fake_torch_tensorrt(calls):
    """A stand-in torch_tensorrt whose compile logs like TensorRT's builder and records its arguments."""
    fake = types.ModuleType("torch_tensorrt")
    fake.__version__ = torch.__version__
    fake.Input = lambda **kw: kw

    def compile(exported, inputs=None, *, sparse_weights=False, workspace_size=0, **kwargs):
        calls.append({"exported": exported, "inputs": inputs, "sparse_weights": sparse_weights})
        builder = logging.getLogger("torch_tensorrt [TensorRT Conversion Context]")
        builder.debug("(Sparsity) Layers eligible for sparse math: fc1, fc2")
        builder.info("(Sparsity) TRT inference plan picked sparse implementation for layers: fc2")
        builder.debug("unrelated verbose line")
        builder.warning("a builder warning")
        return exported.module()

    @contextlib.contextmanager
    def debug():  # like torch_tensorrt.logging.debug: lowers the builder logger's level
        builder = logging.getLogger("torch_tensorrt [TensorRT Conversion Context]")
        level = builder.level
        builder.setLevel(logging.DEBUG)
        yield
        builder.setLevel(level)

    fake.dynamo = types.SimpleNamespace(compile=compile)
    fake.logging = types.SimpleNamespace(debug=debug)
    return fake


def test_compile_aot_plumbing_with_a_stand_in(monkeypatch, caplog):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_tensorrt", _fake_torch_tensorrt(calls))
    monkeypatch.setattr(trt_route, "_check_deployable", lambda model, inputs: {torch.float32})
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(1, 8)  # batch 1: traced with two rows, engine range 1..max_batch
    builder = logging.getLogger("torch_tensorrt [TensorRT Conversion Context]")
    level, propagate = builder.level, builder.propagate
    compiled, log = compile_aot(model, x, max_batch=32)
    assert log == SparsityLog(eligible=("fc1", "fc2"), picked=("fc2",))
    assert (builder.level, builder.propagate) == (level, propagate)
    assert "a builder warning" in caplog.text and "verbose" not in caplog.text  # no verbose flood
    (call,) = calls
    assert call["sparse_weights"] is True
    assert call["inputs"] == [{"min_shape": (1, 8), "opt_shape": (1, 8), "max_shape": (32, 8), "dtype": torch.float32}]
    for batch in (1, 5, 32):
        xb = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(xb), model(xb))


def test_onnx_session_without_onnxruntime(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match="pip install onnxruntime-gpu"):
        onnx_session("model.onnx")


def test_onnx_session_without_tensorrt_provider(monkeypatch):
    fake = types.ModuleType("onnxruntime")
    fake.get_available_providers = lambda: ["CPUExecutionProvider"]
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    with pytest.raises(RuntimeError, match="no TensorrtExecutionProvider.*onnxruntime-gpu"):
        onnx_session("model.onnx")


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="onnxruntime not installed")
def test_onnx_session_with_this_machines_onnxruntime():
    import onnxruntime

    if "TensorrtExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the TensorRT provider")
    with pytest.raises(RuntimeError, match="TensorrtExecutionProvider"):
        onnx_session("model.onnx")


def test_onnx_session_provider_options(monkeypatch, tmp_path):
    seen = {}
    fake = types.ModuleType("onnxruntime")
    fake.get_available_providers = lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    fake.SessionOptions = types.SimpleNamespace

    def session(path, sess_options=None, providers=None):
        seen.update(path=path, options=sess_options, providers=providers)
        return "session"

    fake.InferenceSession = session
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no ONNX file"):
        onnx_session(tmp_path / "missing.onnx")
    cache = tmp_path / "engines"
    assert onnx_session(model, fp16=False, cache_dir=cache, verbose_log=True) == "session"
    name, options = seen["providers"][0]
    assert name == "TensorrtExecutionProvider"
    assert options == {
        "trt_sparsity_enable": True,
        "trt_fp16_enable": False,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache),
        "trt_detailed_build_log": True,
    }
    assert seen["providers"][1:] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert seen["options"].log_severity_level == 0 and cache.is_dir()


# --- a real TensorRT build (GPU) --------------------------------------------------------------


def _torch_tensorrt_importable() -> bool:
    try:
        importlib.import_module("torch_tensorrt")
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.skipif(
    not (torch.cuda.is_available() and _torch_tensorrt_importable()),
    reason="needs a CUDA GPU and torch-tensorrt (pip install \"nmcompile[tensorrt]\")",
)
def test_compile_aot_builds_a_sparse_engine():
    from nmcompile.masks import prune

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        linear = nn.Linear(1024, 1024)
        with torch.no_grad():
            linear.weight.copy_(prune(linear.weight, 2, 4, 1))
        layers += [linear, nn.ReLU()]
    model = nn.Sequential(*layers).cuda().half().eval()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.half)
    compiled, log = compile_aot(model, x)
    print(log)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-2, rtol=1e-2)
        x_small = x[:5].contiguous()
        torch.testing.assert_close(compiled(x_small), model(x_small), atol=1e-2, rtol=1e-2)
    assert log.eligible, "TensorRT's builder log had no (Sparsity) eligible layers"
