"""``python -m polyamp doctor``, the ``"auto"`` policy, and the checkpoint hazard checks."""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import polyamp
import polyamp.backend_api
from polyamp import Hazard, PolyampTypeError, PolyampValueError
from polyamp.__main__ import main
from polyamp._src import doctor
from polyamp._src.doctor import CpuInfo, DeviceInfo, recommend
from polyamp._src.doctor_fp8 import Float8Advice, advise_float8
from polyamp._src.hazards import read_tensors
from polyamp.backend_api import BackendSpec

if TYPE_CHECKING:
    from conftest import ReaderBackend

ROOT = Path(__file__).resolve().parent.parent
NO_BF16_CPU = CpuInfo(False, "neither avx512_bf16 nor amx_bf16", "x86_64")
BF16_CPU = CpuInfo(True, "avx512_bf16 in /proc/cpuinfo", "x86_64")


def _cuda(cc: tuple[int, int] | None, name: str = "GPU", index: int = 0) -> DeviceInfo:
    return DeviceInfo("torch", "cuda", index, name, cc)


def _cpu_has_bf16() -> bool:
    """The rule, read independently: /proc/cpuinfo flags, or torch's own AVX512-BF16 / AMX probes."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    found = bool(flags & {"avx512_bf16", "amx_bf16"})
    torch = sys.modules.get("torch")
    if torch is not None:
        found = found or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return found


def _expected_cpu_policy() -> str:
    return "mixed_bfloat16" if _cpu_has_bf16() else "float32"


def _distribution_version(module: str) -> str:
    """The version of the installed distribution whose files hold the module's ``__init__.py``, found without
    ``packages_distributions`` or the module's name (``tensorflow`` may come from ``tensorflow-cpu``,
    ``tensorflow-intel`` or ``tf-nightly``)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    origin = os.path.realpath(spec.origin)
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            if file.as_posix() == f"{module}/__init__.py" and os.path.realpath(str(dist.locate_file(file))) == origin:
                return str(dist.version)
    raise AssertionError(f"no installed distribution holds {origin}")


def _run(*args: str, keras_backend: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if keras_backend is not None:
        env["KERAS_BACKEND"] = keras_backend
    return subprocess.run(
        [sys.executable, "-m", "polyamp", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240
    )


# --- the decision -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "cpu", "policy"),
    [
        ([_cuda((9, 0), "H100")], NO_BF16_CPU, "mixed_bfloat16"),
        ([_cuda((8, 0), "A100")], NO_BF16_CPU, "mixed_bfloat16"),
        ([_cuda((8, 6), "RTX 3090")], NO_BF16_CPU, "mixed_bfloat16"),
        ([_cuda((7, 5), "T4")], BF16_CPU, "mixed_float16"),  # the GPU decides, not the CPU
        ([_cuda((7, 0), "V100")], NO_BF16_CPU, "mixed_float16"),
        ([_cuda((6, 1), "GTX 1080")], BF16_CPU, "float32"),
        ([_cuda((9, 0), "H100"), _cuda((7, 5), "T4", 1)], NO_BF16_CPU, "mixed_float16"),  # the weakest decides
        ([_cuda(None, "unknown GPU")], BF16_CPU, "float32"),
        ([DeviceInfo("jax", "tpu", 0, "TPU v4")], NO_BF16_CPU, "mixed_bfloat16"),
        ([], BF16_CPU, "mixed_bfloat16"),
        ([], NO_BF16_CPU, "float32"),
        ([DeviceInfo("torch", "mps", 0, "Apple MPS")], NO_BF16_CPU, "float32"),  # autocast() runs on the CPU there
    ],
)
def test_recommend_for_each_kind_of_machine(devices: list[DeviceInfo], cpu: CpuInfo, policy: str) -> None:
    recommendation = recommend(devices, cpu)
    assert recommendation.policy == policy
    polyamp.Policy(recommendation.policy)  # a valid name


def test_recommendation_reasons_name_the_deciding_fact() -> None:
    assert "T4 (compute capability 7.5)" in recommend([_cuda((7, 5), "T4")], NO_BF16_CPU).reason
    assert "lowest of the CUDA devices" in recommend([_cuda((9, 0)), _cuda((7, 5), "T4", 1)], NO_BF16_CPU).reason
    assert "rarely pays" in recommend([], NO_BF16_CPU).reason
    assert "avx512_bf16 in /proc/cpuinfo" in recommend([], BF16_CPU).reason


@pytest.mark.parametrize(
    ("cc", "fp16", "bf16"), [((6, 1), False, False), ((7, 0), True, False), ((7, 5), True, False), ((8, 0), True, True)]
)
def test_tensor_cores_follow_the_compute_capability(cc: tuple[int, int], fp16: bool, bf16: bool) -> None:
    device = _cuda(cc)
    assert (device.float16_tensor_cores, device.bfloat16_tensor_cores) == (fp16, bf16)
    assert device.to_dict()["compute_capability"] == f"{cc[0]}.{cc[1]}"


def test_cpu_bfloat16_from_flags_or_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_cpuinfo_flags", lambda: ({"avx2", "amx_bf16"}, "/proc/cpuinfo"))
    assert doctor.cpu_info() == CpuInfo(True, "amx_bf16 in /proc/cpuinfo", doctor.platform.machine())
    monkeypatch.setattr(doctor, "_cpuinfo_flags", lambda: ({"avx2", "avx512f"}, "/proc/cpuinfo"))
    assert not doctor.cpu_info().bfloat16

    fake_torch = types.SimpleNamespace(
        backends=types.SimpleNamespace(cpu=types.SimpleNamespace(get_cpu_capability=lambda: "AVX512")),
        cpu=types.SimpleNamespace(_is_avx512_bf16_supported=lambda: False, _is_amx_tile_supported=lambda: True),
    )
    info = doctor.cpu_info(fake_torch)
    assert (info.bfloat16, info.evidence, info.torch_capability) == (True, "torch reports AMX tiles", "AVX512")
    fake_torch.cpu = types.SimpleNamespace()  # a torch without the probes: flags alone decide
    info = doctor.cpu_info(fake_torch)
    assert not info.bfloat16
    assert info.evidence == "neither avx512_bf16 nor amx_bf16: /proc/cpuinfo, torch capability AVX512"


# --- "auto" -------------------------------------------------------------------------------------------------


def test_auto_is_the_recommended_policy() -> None:
    recommended = polyamp.recommended_policy()
    auto = polyamp.Policy("auto")
    assert auto == polyamp.Policy(recommended.policy)
    assert auto.name == recommended.policy != "auto"
    assert repr(auto) == f"Policy({recommended.policy!r})"
    if "torch" in sys.modules and not sys.modules["torch"].cuda.is_available():
        assert auto.name == _expected_cpu_policy()
    assert polyamp.set_policy(" AUTO ") == auto
    assert polyamp.get_policy().name == recommended.policy


def test_auto_is_named_in_errors_and_not_a_concrete_name() -> None:
    assert "auto" not in polyamp.backend_api.policies.POLICY_NAMES
    with pytest.raises(polyamp.InvalidPolicyError, match=r"Did you mean 'auto'\?.*or 'auto' \(the policy"):
        polyamp.Policy("atuo")


def test_auto_imports_only_when_resolved_and_never_beside_an_imported_framework() -> None:
    code = (
        "import sys, json\n"
        "import polyamp\n"
        "before = sorted(m for m in ('torch', 'tensorflow', 'jax', 'keras', 'numpy') if m in sys.modules)\n"
        "name = polyamp.Policy('auto').name\n"
        "after = sorted(m for m in ('torch', 'tensorflow', 'jax', 'keras') if m in sys.modules)\n"
        "print(json.dumps([before, after, name]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    before, after, name = json.loads(out.stdout.splitlines()[-1])
    assert before == []
    first_installed = next(fw for fw in ("torch", "tensorflow", "jax") if importlib.util.find_spec(fw))
    others = {"torch", "tensorflow", "jax"} - {first_installed}
    assert first_installed in after and not others & set(after)  # the first installed one, alone
    assert name in ("float32", "mixed_float16", "mixed_bfloat16")


# --- the hazard rules ---------------------------------------------------------------------------------------


def _kinds(hazards: list[Hazard]) -> list[tuple[str, str]]:
    return [(h.kind, h.name) for h in hazards]


@pytest.mark.parametrize(
    ("max_abs", "mixed_float16", "float16"),
    [
        (4096.0, [], []),
        (4096.5, ["float16_range"], ["float16_range"]),
        (65504.0, ["float16_range"], ["float16_range"]),
        (65504.5, ["float16_overflow"], ["float16_overflow"]),
        (math.inf, ["non_finite"], ["non_finite"]),
        (math.nan, ["non_finite"], ["non_finite"]),
    ],
)
def test_float16_range_thresholds(max_abs: float, mixed_float16: list[str], float16: list[str]) -> None:
    assert [h.kind for h in polyamp.find_hazards([("w", "float32", max_abs)], "mixed_float16")] == mixed_float16
    assert [h.kind for h in polyamp.find_hazards([("w", "float32", max_abs)], "float16")] == float16
    under_bf16 = ["non_finite"] if not math.isfinite(max_abs) else []
    assert [h.kind for h in polyamp.find_hazards([("w", "float32", max_abs)], "mixed_bfloat16")] == under_bf16
    assert [h.kind for h in polyamp.find_hazards([("w", "float32", max_abs)], "float32")] == under_bf16


@pytest.mark.parametrize(
    ("name", "rotary"),
    [
        ("model.layers.0.self_attn.rotary_emb.inv_freq", True),
        ("inv_freq", True),
        ("rope.freqs", True),
        ("blocks.0.RoPE_cache", True),
        ("encoder/RotaryEmbedding/freq", True),
        ("property_head.weight", False),  # "rope" inside a word is not a rotary buffer
        ("europe.weight", False),
        ("fc.weight", False),
    ],
)
def test_rotary_names(name: str, rotary: bool) -> None:
    found = polyamp.find_hazards([(name, "float32", 1.0)], "mixed_bfloat16")
    assert _kinds(found) == ([("rotary_buffer", name)] if rotary else [])
    assert polyamp.find_hazards([(name, "float32", 1.0)], "float32") == []


def test_norm_statistics_only_under_low_precision_parameters() -> None:
    stats = [("bn.running_mean", "float32", 3.0), ("bn/moving_variance", "float32", 2.0), ("bn.weight", "float32", 1.0)]
    assert polyamp.find_hazards(stats, "mixed_bfloat16") == []
    assert polyamp.find_hazards(stats, "mixed_float16") == []
    expected = [("norm_statistics", "bn.running_mean"), ("norm_statistics", "bn/moving_variance")]
    assert _kinds(polyamp.find_hazards(stats, "bfloat16")) == expected
    assert _kinds(polyamp.find_hazards(stats, "params=float16,compute=float16,output=float32")) == expected


def test_integer_bool_and_complex_tensors_are_ignored() -> None:
    tensors = [("steps", "int64", None), ("mask", "bool", None), ("inv_freq", "int32", None), ("z", "complex64", None)]
    assert polyamp.find_hazards(tensors, "float16") == []


def test_a_hazard_says_what_why_and_the_fix() -> None:
    (hazard,) = polyamp.find_hazards([("encoder.proj.weight", "float32", 1e5)], "mixed_float16")
    assert hazard == Hazard(
        kind="float16_overflow",
        name="encoder.proj.weight",
        dtype="float32",
        value=1e5,
        severity="error",
        policy="mixed_float16",
        message=hazard.message,
    )
    assert "max |w| = 100000" in hazard.message and "65504" in hazard.message
    assert "'mixed_bfloat16'" in hazard.message and "keep_float32=['encoder.proj']" in hazard.message
    assert str(hazard) == hazard.message
    with pytest.raises(AttributeError):
        hazard.kind = "other"  # type: ignore[misc]
    assert json.loads(json.dumps(hazard.to_dict()))["value"] == 1e5


def test_find_hazards_rejects_what_is_not_a_triple() -> None:
    with pytest.raises(PolyampTypeError, match=r"\(name, dtype, max_abs\) triples.*Received: \('w', 'float32'\)"):
        polyamp.find_hazards([("w", "float32")], "mixed_float16")  # type: ignore[list-item]
    with pytest.raises(polyamp.InvalidPolicyError):
        polyamp.find_hazards([], "fp17")


# --- readers: torch ---------------------------------------------------------------------------------------


@pytest.fixture
def torch_state() -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    weight = torch.full((3, 4), 0.5)
    weight[1, 2] = -1e5
    return {
        "fc.weight": weight,
        "fc.bias": torch.zeros(3),
        "rotary_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)),
        "steps": torch.tensor(10**6),  # integers are ignored
    }


def test_torch_state_dict_hazards_per_policy(torch_state: dict[str, Any]) -> None:
    under_f16 = polyamp.check_hazards(torch_state, "mixed_float16")
    assert _kinds(under_f16) == [("float16_overflow", "fc.weight"), ("rotary_buffer", "rotary_emb.inv_freq")]
    assert under_f16[0].value == 1e5 and under_f16[0].dtype == "float32"
    assert under_f16[1].value == float(torch_state["rotary_emb.inv_freq"].abs().max()) == 1.0
    assert _kinds(polyamp.check_hazards(torch_state, "mixed_bfloat16")) == [("rotary_buffer", "rotary_emb.inv_freq")]
    assert polyamp.check_hazards(torch_state, "float32") == []
    with polyamp.policy_scope("mixed_bfloat16"):  # None: the policy in effect
        assert [h.policy for h in polyamp.check_hazards(torch_state)] == ["mixed_bfloat16"]


def test_torch_checkpoint_file_and_module(torch_state: dict[str, Any], tmp_path: Path) -> None:
    import torch

    path = tmp_path / "model.pt"
    torch.save({"state_dict": torch_state, "epoch": 3}, path)
    expected = [("float16_overflow", "fc.weight"), ("rotary_buffer", "rotary_emb.inv_freq")]
    assert _kinds(polyamp.check_hazards(path, "mixed_float16")) == expected
    assert _kinds(polyamp.check_hazards(str(path), "mixed_float16")) == expected

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.norm = torch.nn.BatchNorm1d(3)
            self.register_buffer("inv_freq", torch.ones(2, dtype=torch.bfloat16), persistent=False)

    model = Model()
    with torch.no_grad():
        model.fc.weight[0, 0] = 1e5
    bf16_value = float(torch.tensor(1e5, dtype=torch.bfloat16))
    model.fc.to(torch.bfloat16)
    found = polyamp.check_hazards(model, "float16")
    assert _kinds(found) == [
        ("float16_overflow", "fc.weight"),
        ("rotary_buffer", "inv_freq"),  # a non-persistent buffer: not in state_dict(), still checked
        ("norm_statistics", "norm.running_mean"),
        ("norm_statistics", "norm.running_var"),
    ]
    assert (found[0].dtype, found[0].value) == ("bfloat16", bf16_value)  # max |w| as stored: 99840.0


def test_torch_checkpoint_with_nan(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pth"
    torch.save({"model": {"w": torch.tensor([1.0, float("nan")])}}, path)
    (hazard,) = polyamp.check_hazards(path, "float32")
    assert (hazard.kind, hazard.name, hazard.severity) == ("non_finite", "w", "error")
    assert math.isnan(hazard.value or 0.0) and hazard.to_dict()["value"] is None


def test_safetensors(torch_state: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    if importlib.util.find_spec("safetensors") is None:
        path.write_bytes(b"")
        with pytest.raises(polyamp.BackendNotInstalledError, match=r"needs the safetensors package.*pip install"):
            polyamp.check_hazards(path, "mixed_float16")
        return
    from safetensors.torch import save_file

    save_file({k: v for k, v in torch_state.items()}, str(path))
    assert _kinds(polyamp.check_hazards(path, "mixed_float16")) == [
        ("float16_overflow", "fc.weight"),
        ("rotary_buffer", "rotary_emb.inv_freq"),
    ]


def test_unreadable_sources_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(PolyampValueError, match=r"No file at .*missing\.pt"):
        polyamp.check_hazards(tmp_path / "missing.pt")
    with pytest.raises(PolyampValueError, match=r"No tensor reader opens .*model\.onnx.*\.pt, .*\.weights\.h5"):
        polyamp.check_hazards(tmp_path / "model.onnx")
    with pytest.raises(PolyampTypeError, match=r"checkpoint path, a model or state dict.*arrays.*Received: 3"):
        polyamp.check_hazards(3)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(PolyampValueError, match=r"not a checkpoint torch.load can read .*corrupt or truncated"):
        polyamp.check_hazards(bad, "mixed_float16")


def test_a_registered_backend_reader_is_used(reader_backend: ReaderBackend, tmp_path: Path) -> None:
    seen: list[object] = []

    def read(source: object) -> list[tuple[str, str, float | None]]:
        seen.append(source)
        return [("big", "float16", 7e4), ("n", "int8", None)]

    reader_backend("fakefw", read, (".fake", ".big.fake"))
    model = type("Model", (), {"__module__": "fakefw.models"})()
    assert _kinds(polyamp.check_hazards(model, "mixed_float16")) == [("float16_overflow", "big")]
    path = tmp_path / "m.big.fake"
    path.write_text("")
    assert _kinds(polyamp.check_hazards(path, "mixed_float16")) == [("float16_overflow", "big")]
    assert seen == [model, path]


@pytest.mark.parametrize("suffixes", [".pt", ("pt",), ("",)])
def test_backend_spec_checks_its_suffixes(suffixes: object) -> None:
    with pytest.raises(PolyampTypeError, match=r"checkpoint_suffixes must"):
        BackendSpec("x", "x:y", ("x",), "pip install x", checkpoint_suffixes=suffixes)  # type: ignore[arg-type]


# --- readers: sparse and float8 tensors ------------------------------------------------------------------

FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")  # torch's notes on sparse invariants and CSR's beta state
def test_sparse_tensors_are_read_through_their_values(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "sparse.pt"
    # Two entries at the same index sum to 80000 once coalesced; the dense tensor is never built.
    coo = torch.sparse_coo_tensor([[0, 0], [1, 1]], [40000.0, 40000.0], (3, 3))
    torch.save(
        {"coo": coo, "csr": torch.eye(3).mul(5000.0).to_sparse_csr(), "empty": torch.zeros(2, 2).to_sparse()}, path
    )
    found = polyamp.check_hazards(path, "mixed_float16")
    assert [(h.kind, h.name, h.value) for h in found] == [
        ("float16_overflow", "coo", 80000.0),
        ("float16_range", "csr", 5000.0),
    ]


def _float8(torch: Any, dtype: str, values: list[float]) -> Any:
    return torch.tensor(values).to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_float8_checkpoints_report_their_range(tmp_path: Path, dtype: str, suffix: str) -> None:
    torch = pytest.importorskip("torch")
    values = [0.25, 2.0, 8.0] if dtype == "float8_e8m0fnu" else [0.25, 2.0, -8.0]  # e8m0: powers of two, no sign
    state = {"w": _float8(torch, dtype, values), "n": torch.tensor([3])}
    path = tmp_path / f"m{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    else:
        pytest.importorskip("safetensors.torch").save_file(state, str(path))
    assert sorted(read_tensors(path)) == [("n", "int64", None), ("w", dtype, 8.0)]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ""])
def test_float8_e8m0_reaches_2_127_and_overflows_float16(tmp_path: Path, suffix: str) -> None:
    torch = pytest.importorskip("torch")
    state = {"scales": _float8(torch, "float8_e8m0fnu", [1.0, 2.0**127])}
    source: object = state
    if suffix:
        source = tmp_path / f"m{suffix}"
        if suffix == ".pt":
            torch.save(state, source)
        else:
            pytest.importorskip("safetensors.torch").save_file(state, str(source))
    (hazard,) = polyamp.check_hazards(source, "mixed_float16")
    assert (hazard.kind, hazard.dtype, hazard.value) == ("float16_overflow", "float8_e8m0fnu", 2.0**127)
    assert polyamp.check_hazards(source, "mixed_bfloat16") == []


def test_float8_nan_is_non_finite() -> None:
    torch = pytest.importorskip("torch")
    (hazard,) = polyamp.check_hazards({"w": _float8(torch, "float8_e4m3fn", [1.0, float("nan")])}, "float32")
    assert (hazard.kind, hazard.dtype) == ("non_finite", "float8_e4m3fn")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_large_float8_tensors_are_read_in_blocks(tmp_path: Path, suffix: str) -> None:
    torch = pytest.importorskip("torch")
    weight = torch.zeros(6, 2**20, dtype=torch.float8_e5m2)  # 6 MiB: more than one block
    weight[5, -1] = 40000.0  # the last element of the last block
    path = tmp_path / f"m{suffix}"
    if suffix == ".pt":
        torch.save({"w": weight}, path)
    else:
        pytest.importorskip("safetensors.torch").save_file({"w": weight}, str(path))
    (hazard,) = polyamp.check_hazards(path, "mixed_float16")
    assert (hazard.kind, hazard.dtype, hazard.value) == ("float16_range", "float8_e5m2", 40960.0)


# --- readers: Keras ---------------------------------------------------------------------------------------


def _keras_model() -> Any:
    keras = pytest.importorskip("keras")
    import numpy as np

    @keras.saving.register_keras_serializable(package="polyamp_doctor_test")
    class Frequencies(keras.layers.Layer):
        def build(self, input_shape: Any) -> None:
            self.inv_freq = self.add_weight(shape=(4,), name="inv_freq", trainable=False, initializer="ones")

        def call(self, x: Any) -> Any:
            return x * self.inv_freq

    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="proj"), Frequencies(name="freqs")], name="net"
    )
    kernel = np.full((4, 4), 0.25, dtype="float32")
    kernel[2, 1] = 1e5
    model.get_layer("proj").kernel.assign(kernel)
    return model


def test_keras_model_hazards_per_policy(tmp_path: Path) -> None:
    model = _keras_model()
    under_f16 = polyamp.check_hazards(model, "mixed_float16")
    assert _kinds(under_f16) == [("float16_overflow", "net/proj/kernel"), ("rotary_buffer", "net/freqs/inv_freq")]
    assert under_f16[0].value == 1e5 and "keep_float32=['net/proj']" in under_f16[0].message
    assert _kinds(polyamp.check_hazards(model, "mixed_bfloat16")) == [("rotary_buffer", "net/freqs/inv_freq")]
    assert polyamp.check_hazards(model, "float32") == []

    path = tmp_path / "net.keras"
    model.save(path)
    loaded = polyamp.check_hazards(path, "mixed_float16")  # the loaded model's paths drop the model's name
    assert _kinds(loaded) == [("float16_overflow", "proj/kernel"), ("rotary_buffer", "freqs/inv_freq")]
    assert [h.value for h in loaded] == [h.value for h in under_f16]


def test_keras_weights_file_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _keras_model()
    path = tmp_path / "net.weights.h5"
    model.save_weights(path)
    # A weights file keeps no variable names, only storage paths: layers/<layer class>/vars/<index>.
    hazards = polyamp.check_hazards(path, "mixed_float16")
    assert [(h.kind, h.name, h.value) for h in hazards] == [("float16_overflow", "layers/dense/vars/0", 1e5)]

    # The weights file needs no particular Keras backend: read it on the lightest one installed.
    backend = next((b for b in ("jax", "torch", "tensorflow") if importlib.util.find_spec(b)), None)
    result = _run("doctor", "--json", "--framework", "jax", "--check", str(path), keras_backend=backend)
    assert result.returncode == 1, result.stderr
    check = json.loads(result.stdout)["check"]
    assert check["policy"] == "mixed_float16" and check["tensors"] == 3
    assert [(h["kind"], h["name"], h["value"]) for h in check["hazards"]] == [
        ("float16_overflow", "layers/dense/vars/0", 1e5)
    ]
    assert main(["doctor", "--framework", "torch", "--check", str(path), "--policy", "mixed_bfloat16"]) == 0
    assert "under 'mixed_bfloat16': 3 tensors (3 floating), 0 hazards\n  no hazard found" in capsys.readouterr().out


def test_a_file_no_reader_can_read_is_called_corrupt_in_every_format(tmp_path: Path) -> None:
    junk = bytes(range(256)) * 4
    formats = [".pt", ".safetensors", ".keras", ".weights.h5", ".npz"]
    if importlib.util.find_spec("torch") is None:
        formats.remove(".pt")
    for suffix in formats:
        path = tmp_path / f"junk{suffix}"
        path.write_bytes(junk)
        with pytest.raises(polyamp.CheckpointError) as caught:
            polyamp.check_hazards(path, "mixed_float16")
        message = str(caught.value)
        assert message.startswith(f"Cannot read the checkpoint {str(path)!r}: "), message
        assert message.endswith("The file is corrupt or truncated: re-download or re-save it."), message
        assert "file an issue" not in message and "weights_only" not in message and len(message) < 400, message


def test_a_torch_pickle_of_python_objects_is_refused_as_such(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "objects.pt"
    torch.save({"w": torch.ones(2), "config": types.SimpleNamespace(lr=0.1)}, path)
    with pytest.raises(polyamp.CheckpointError, match=r"holds Python objects .*GLOBAL types.SimpleNamespace.*never"):
        polyamp.check_hazards(path, "mixed_float16")


def test_the_pytorch_tutorial_checkpoint_is_read_as_its_model(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import polyamp_torch

    def model() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            collections.OrderedDict(fc=torch.nn.Linear(3, 3), bn=torch.nn.BatchNorm1d(3), head=torch.nn.Linear(3, 1))
        )

    net = model()
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.state[net.fc.weight]["exp_avg_sq"].fill_(math.inf)  # an overflowed moment: not the model's weights
    path = tmp_path / "checkpoint.pt"
    torch.save(
        {"epoch": 3, "model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer.state_dict(), "loss": 0.5},
        path,
    )
    found = polyamp.check_hazards(path, "bfloat16")
    # The model's part alone, named as in the model: the advice is one apply_policy takes.
    assert _kinds(found) == [("norm_statistics", "bn.running_mean"), ("norm_statistics", "bn.running_var")]
    assert "keep_float32=['bn']" in found[0].message
    polyamp_torch.apply_policy(model(), "bfloat16", keep_float32=["bn"])


def _bn_model() -> Any:
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="proj")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    hidden = keras.layers.BatchNormalization(center=False, name="norm_nocenter")(hidden)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden), name="net")


def test_a_weights_file_gets_the_name_rules_of_its_keras_file(tmp_path: Path) -> None:
    model = _bn_model()
    model.save(tmp_path / "net.keras")
    model.save_weights(tmp_path / "net.weights.h5")
    from_keras = polyamp.check_hazards(tmp_path / "net.keras", "bfloat16")
    from_weights = polyamp.check_hazards(tmp_path / "net.weights.h5", "bfloat16")
    expected = [
        (kind, f"{layer}/{variable}")
        for layer in ("norm", "norm_nocenter")
        for kind, variable in (("norm_statistics", "moving_mean"), ("norm_statistics", "moving_variance"))
    ]
    assert _kinds(from_keras) == expected and _kinds(from_weights) == expected
    assert [h.message for h in from_weights] == [h.message for h in from_keras]
    # The other variables keep their storage paths (the file does not name them): a layer's one trainable
    # variable of BatchNormalization(center=False) is gamma or beta, which the file does not say.
    names = [t.name for t in read_tensors(tmp_path / "net.weights.h5")]
    assert names[:4] == ["norm/gamma", "norm/beta", "norm/moving_mean", "norm/moving_variance"]
    assert "layers/batch_normalization_1/vars/0" in names and "layers/dense/vars/0" in names


def test_numpy_files_and_trees_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "params.npz"
    np.savez_compressed(
        path,
        **{
            "dense/kernel": np.full((3, 3), 7e4, np.float32),
            "bn/moving_mean": np.array([1.0, np.nan]),
            "step": np.array(3),
        },
    )
    assert _kinds(polyamp.check_hazards(path, "mixed_float16")) == [
        ("float16_overflow", "dense/kernel"),
        ("non_finite", "bn/moving_mean"),
    ]
    tree = {"params": {"Dense_0": {"kernel": np.full((2,), 5e3, np.float32)}, "rope": [np.ones(2)]}, "step": 3}
    assert [(h.kind, h.name, h.value) for h in polyamp.check_hazards(tree, "mixed_float16")] == [
        ("float16_range", "params/Dense_0/kernel", 5e3),
        ("rotary_buffer", "params/rope/0", 1.0),
    ]
    objects = tmp_path / "objects.npz"
    np.savez(objects, a=np.array([{"x": 1}], dtype=object))
    with pytest.raises(polyamp.CheckpointError, match="holds Python objects, which polyamp never unpickles"):
        polyamp.check_hazards(objects)
    big = tmp_path / "big.npz"
    np.savez_compressed(big, zeros=np.zeros(1 << 16, np.float32))  # small on disk, 256 KiB declared
    with pytest.raises(polyamp.CheckpointError, match=r"declare 262144 bytes"):
        polyamp.check_hazards(big, max_bytes=1 << 16)


def test_jax_pytrees_and_orbax_checkpoints_are_checked(tmp_path: Path) -> None:
    jnp = pytest.importorskip("jax.numpy")
    nnx = pytest.importorskip("flax.nnx")
    ocp = pytest.importorskip("orbax.checkpoint")
    linen = {
        "params": {"Dense_0": {"kernel": jnp.full((2, 2), 7e4)}},
        "batch_stats": {"BatchNorm_0": {"mean": jnp.zeros(2), "var": jnp.ones(2)}},
    }
    expected = [  # in the pytree's order (JAX sorts dict keys)
        ("norm_statistics", "batch_stats/BatchNorm_0/mean"),
        ("norm_statistics", "batch_stats/BatchNorm_0/var"),
        ("float16_overflow", "params/Dense_0/kernel"),
    ]
    assert _kinds(polyamp.check_hazards(linen, "float16")) == expected
    module = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
    module.layers[0].kernel[0, 0] = jnp.nan
    assert _kinds(polyamp.check_hazards(module, "bfloat16")) == [
        ("non_finite", "layers/0/kernel"),
        ("norm_statistics", "batch_stats/layers/1/mean"),
        ("norm_statistics", "batch_stats/layers/1/var"),
    ]
    assert _kinds(polyamp.check_hazards(nnx.state(module), "bfloat16")) == _kinds(
        polyamp.check_hazards(module, "bfloat16")
    )
    # orbax: an item's directory, and a checkpoint manager's step (the manager's own directory is refused, naming
    # its steps); the command line reads them too.
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "item", linen)
    checkpointer.wait_until_finished()
    manager = ocp.CheckpointManager(tmp_path / "runs")
    manager.save(7, args=ocp.args.StandardSave(linen))
    manager.wait_until_finished()
    assert _kinds(polyamp.check_hazards(tmp_path / "item", "float16")) == expected
    assert _kinds(polyamp.check_hazards(tmp_path / "runs" / "7", "float16")) == expected
    with pytest.raises(PolyampValueError, match=r"subdirectories \['7'\].*pass one of them"):
        polyamp.check_hazards(tmp_path / "runs")
    with pytest.raises(PolyampValueError, match=r"No tensor reader opens the directory .*orbax|_METADATA"):
        polyamp.check_hazards(tmp_path)
    assert main(["doctor", "--framework", "jax", "--check", str(tmp_path / "item"), "--policy", "float16"]) == 1


# --- the command line -------------------------------------------------------------------------------------


def test_doctor_report_without_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without CUDA")
    result = _run("doctor", "--framework", "torch")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "polyamp doctor"
    assert f"  polyamp     {polyamp.__version__}" in lines
    assert f"  torch       {_distribution_version('torch')}" in lines
    no_cuda = [line for line in lines if line.startswith("  no CUDA device: ")]
    assert no_cuda == [
        f"  no CUDA device: torch {torch.__version__} "
        + ("is built without CUDA" if torch.version.cuda is None else "(CUDA ")
        + ("" if torch.version.cuda is None else f"{torch.version.cuda}): torch.cuda.is_available() is False")
    ]
    assert "Devices (probed: torch)" in lines
    assert f"Recommended policy: {_expected_cpu_policy()}" in lines


class _FakeDistribution:
    """What the doctor reads of an installed distribution: its version and the files it installed."""

    def __init__(self, version: str, files: list[str], root: Path) -> None:
        self.version = version
        self.files = [importlib.metadata.PackagePath(f) for f in files]
        self._root = root

    def locate_file(self, path: Any) -> Path:
        return self._root / str(path)


def _installed_as(
    monkeypatch: pytest.MonkeyPatch, providers: dict[str, list[str]], dists: dict[str, _FakeDistribution]
) -> None:
    """importlib.metadata as it reads where these distributions, and no other, are installed."""

    def distribution(name: str) -> _FakeDistribution:
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: providers)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)


def test_a_framework_version_comes_from_the_distribution_that_provides_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = tmp_path / "site" / "fakefw"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    site, elsewhere = tmp_path / "site", tmp_path / "old-site"

    # Named otherwise than the module, as tensorflow-cpu, tensorflow-intel and tf-nightly are.
    _installed_as(monkeypatch, {"fakefw": ["fakefw-cpu"]}, {"fakefw-cpu": _FakeDistribution("2.18.1", [], site)})
    assert doctor._version("fakefw") == "2.18.1"

    # Several distributions write under "fakefw": the one whose __init__.py is the one imported is reported,
    # not a plugin's, nor a stale install's in another directory, nor one named like the module.
    plugin = _FakeDistribution("0.3.0", ["fakefw/plugins/io.py"], site)
    stale = _FakeDistribution("1.0.0", ["fakefw/__init__.py"], elsewhere)
    nightly = _FakeDistribution("2.19.0.dev20260101", ["fakefw/__init__.py", "fakefw/core.py"], site)
    named_like_it = _FakeDistribution("2.17.0", ["fakefw_other/__init__.py"], site)
    dists = {"fakefw-io": plugin, "fakefw-old": stale, "tf-nightly": nightly, "fakefw": named_like_it}
    _installed_as(monkeypatch, {"fakefw": ["fakefw-io", "fakefw-old", "tf-nightly"]}, dists)
    assert doctor._version("fakefw") == "2.19.0.dev20260101"
    _installed_as(monkeypatch, {"fakefw": ["fakefw-io", "fakefw-old"]}, dists)  # none holds it: the first found
    assert doctor._version("fakefw") == "0.3.0"

    _installed_as(monkeypatch, {}, {})  # importable, installed by no distribution (a source checkout)
    assert doctor._version("fakefw") == "unknown"
    assert doctor._version("fakefw_not_installed") is None


def test_the_report_names_the_version_of_tensorflow_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("tensorflow", tmp_path / "tensorflow" / "__init__.py")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: spec if name == "tensorflow" else real_find_spec(name, *a)
    )
    cpu = _FakeDistribution("2.20.0", ["tensorflow/__init__.py"], tmp_path)
    _installed_as(monkeypatch, {"tensorflow": ["tensorflow-cpu"]}, {"tensorflow-cpu": cpu})
    report = doctor.diagnose(frameworks=())
    assert report.frameworks["tensorflow"] == {"installed": True, "version": "2.20.0"}
    assert "  tensorflow  2.20.0" in report.format().splitlines()


@pytest.mark.parametrize(
    ("capability", "support", "policy"),
    [
        ((10, 0), "native", "mixed_bfloat16+mxfp8"),
        ((9, 0), "native", "float8_tensorwise"),
        ((8, 9), "native", "float8_tensorwise"),
        ((8, 0), "emulated", None),
    ],
)
def test_the_fp8_advice_follows_the_lowest_compute_capability(
    capability: tuple[int, int], support: str, policy: str | None
) -> None:
    devices = [DeviceInfo("torch", "cuda", 0, "GPU", capability), DeviceInfo("torch", "cuda", 1, "B200", (10, 0))]
    advice = advise_float8(devices, frameworks=["torch", "keras"])
    assert (advice.support, advice.policy) == (support, policy)
    assert advise_float8(devices, frameworks=["keras"]) == advice  # each framework runs every recipe
    if policy is not None:
        assert polyamp.Policy(policy).float8 is not None  # the advice is a policy the grammar takes


def test_the_fp8_advice_without_a_gpu_or_without_an_fp8_framework() -> None:
    emulated = advise_float8([], frameworks=["jax", "torch"])
    assert emulated.support == "emulated" and "on the CPU (PyTorch, JAX)" in emulated.reason
    assert advise_float8([], frameworks=["tensorflow"]) == Float8Advice(
        "none",
        None,
        "none of PyTorch, Keras and JAX is installed: polyamp's FP8 layers run on polyamp_torch, polyamp_keras "
        "and polyamp_jax.",
    )
    report = doctor.diagnose(frameworks=())
    assert report.float8 is not None and "FP8: " in report.format()


@pytest.mark.slow
def test_doctor_json_has_stable_keys() -> None:
    result = _run("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report) == [
        "python",
        "polyamp",
        "platform",
        "frameworks",
        "probed",
        "devices",
        "cuda",
        "cpu",
        "notes",
        "recommendation",
        "float8",
        "check",
        "training_state",
    ]
    assert report["polyamp"] == polyamp.__version__ and report["check"] is None
    assert list(report["frameworks"]) == ["torch", "tensorflow", "keras", "jax"]
    installed = []
    for name, info in report["frameworks"].items():
        present = importlib.util.find_spec(name) is not None
        assert info["installed"] is present
        if present:
            installed.append(name)
            assert info["version"] == _distribution_version(name)
    if report["frameworks"]["keras"]["installed"]:
        assert report["frameworks"]["keras"]["backend"] in ("tensorflow", "jax", "torch", "numpy", "openvino")
    assert report["probed"] == [fw for fw in ("torch", "tensorflow", "jax") if fw in installed]
    assert list(report["cpu"]) == ["bfloat16", "evidence", "machine", "torch_capability"]
    if not report["cuda"]:
        assert report["devices"] == [] or all(d["kind"] != "cuda" for d in report["devices"])
        assert report["cpu"]["bfloat16"] is _cpu_has_bf16()
        assert report["recommendation"]["policy"] == _expected_cpu_policy()


def test_exit_codes(torch_state: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    path = tmp_path / "model.pt"
    torch.save(torch_state, path)
    assert main(["doctor", "--framework", "torch", "--check", str(path)]) == 1  # mixed_float16 by default
    out = capsys.readouterr().out
    assert "under 'mixed_float16': 4 tensors (3 floating), 2 hazards" in out
    assert "  error: [float16_overflow] fc.weight (float32) has max |w| = 100000" in out
    assert "  warning: [rotary_buffer] rotary_emb.inv_freq (float32)" in out
    assert main(["doctor", "--framework", "torch", "--check", str(path), "--policy", "float32"]) == 0
    assert main(["doctor", "--framework", "torch"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--framework", "torch", "--check", str(tmp_path / "nothing.pt")]) == 2
    assert "cannot check" in capsys.readouterr().err
    assert main(["doctor", "--check", str(path), "--policy", "fp17"]) == 2
    assert "--policy: Unknown policy 'fp17'" in capsys.readouterr().err
    assert main(["doctor", "--policy", "float16"]) == 2
    assert "--policy needs --check PATH" in capsys.readouterr().err
    assert main(["doctor", "--framework", "mxnet"]) == 2
    assert "invalid choice: 'mxnet'" in capsys.readouterr().err
    assert main(["doctor", "--help"]) == 0
    assert main([]) == 2
    assert main(["doctr"]) == 2
    assert "unknown command 'doctr'" in capsys.readouterr().err


def test_import_polyamp_and_the_rules_import_no_framework_nor_numpy() -> None:
    code = (
        "import sys, polyamp\n"
        "polyamp.find_hazards([('w', 'float32', 1e5)], 'mixed_float16')\n"
        "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'jax', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --- the training state -----------------------------------------------------------------------------------------


def test_doctor_reports_the_training_state_per_plan() -> None:
    result = _run("doctor", "--json", "--framework", "jax", "--parameters", "125M")
    assert result.returncode == 0, result.stderr
    rows = {row["policy"]: row for row in json.loads(result.stdout)["training_state"]}
    assert {name: row["per_parameter"] for name, row in rows.items()} == {
        "float32": 16,
        "mixed_bfloat16": 16,
        "bfloat16": 8,
        "bfloat16_float32_master": 16,
        "bfloat16_kahan": 10,
        "bfloat16_stochastic": 8,
    }
    assert rows["bfloat16_kahan"]["total"] == 10 * 125_000_000
    text = _run("doctor", "--framework", "jax", "--slots", "1").stdout
    assert "Training state per parameter (an optimizer with 1 slot per parameter" in text
    assert "  bfloat16_kahan                 2      2       0      2             2      8" in text
    bad = _run("doctor", "--parameters", "lots")
    assert bad.returncode == 2 and "expected a positive number of parameters" in bad.stderr and "'lots'" in bad.stderr


def test_devices_come_from_each_backends_device_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    import polyamp_torch._devices

    specs = polyamp.backend_api.backend_specs()
    assert {name: specs[name].device_probe for name in doctor.FRAMEWORKS} == {
        "torch": "polyamp_torch._devices:probe_devices",
        "tensorflow": "polyamp_tensorflow._devices:probe_devices",
        "jax": "polyamp_jax._devices:probe_devices",
    }
    found = [("cuda", 0, "NVIDIA H100 80GB HBM3", (9, 0)), ("cuda", 1, "NVIDIA H100 80GB HBM3", (9, 0))]
    monkeypatch.setattr(polyamp_torch._devices, "probe_devices", lambda: (found, []))
    report = doctor.diagnose(frameworks=["torch"])
    assert [(d.framework, d.kind, d.index, d.name, d.compute_capability) for d in report.devices] == [
        ("torch", *device) for device in found
    ]
    assert report.recommendation.policy == "mixed_bfloat16" and report.notes == ()
    monkeypatch.setattr(polyamp_torch._devices, "probe_devices", lambda: 1 / 0)
    broken = doctor.diagnose(frameworks=["torch"])
    assert broken.devices == () and broken.probed == ()
    assert broken.notes == ("torch: could not list devices (ZeroDivisionError: division by zero)",)


def test_the_doctor_names_what_loading_an_fp8_checkpoint_converts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    polyamp_torch = pytest.importorskip("polyamp_torch")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    polyamp_torch.apply_policy(model, "float8_delayed[amax_history_length=4]")
    model(torch.randn(4, 32)).sum().backward()
    fp8_path, plain_path = tmp_path / "fp8.pt", tmp_path / "plain.pt"
    torch.save(model.state_dict(), fp8_path)
    polyamp_torch.remove_policy(model)
    torch.save(model.state_dict(), plain_path)

    # Into a bfloat16 model: each layer's six state tensors are named as dropped, the exit status stays 0.
    assert main(["doctor", "--framework", "torch", "--check", str(fp8_path), "--policy", "mixed_bfloat16"]) == 0
    out = capsys.readouterr().out
    for layer in ("0", "1"):
        assert f"  FP8: '{layer}': FP8 delayed-scaling state (6 tensors: {layer}.float8_input_amax_history," in out
    assert out.count("has no place under 'mixed_bfloat16': loading drops it") == 2
    # Into a model under the same recipe it resumes; a 16-bit checkpoint starts the recipe's state fresh.
    assert (
        main(["doctor", "--json", "--framework", "torch", "--check", str(fp8_path), "--policy", "float8_delayed"]) == 0
    )
    lines = json.loads(capsys.readouterr().out)["check"]["float8"]
    assert len(lines) == 2 and all(line.endswith("resumes the amax histories and scales.") for line in lines)
    assert (
        main(["doctor", "--json", "--framework", "torch", "--check", str(plain_path), "--policy", "float8_delayed"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["check"]["float8"] == [
        "no FP8 delayed-scaling state: under 'float8_delayed' each converted layer starts with a scale of 1 and an "
        "empty amax history (the first steps cast with that scale); the weights load unchanged."
    ]
    assert (
        main(["doctor", "--json", "--framework", "torch", "--check", str(plain_path), "--policy", "mixed_bfloat16"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["check"]["float8"] == []
