"""`dtype: auto` picks float32 on CPUs that only emulate bfloat16 (6x slower here), bf16 elsewhere."""
import pytest

from prefillshare.app.engine import compute_dtype
from prefillshare.app.engine.async_engine import EngineConfig
from prefillshare.app.plan import kv_bytes_per_token

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"


def test_auto_is_float32_on_a_cpu_without_native_bf16():
    assert compute_dtype.resolve("auto", cuda=False, cpuinfo=AVX2) == "float32"


@pytest.mark.parametrize("cuda, info", [(False, SAPPHIRE), (True, AVX2)])
def test_auto_is_bfloat16_where_it_is_computed_natively(cuda, info):
    assert compute_dtype.resolve("auto", cuda=cuda, cpuinfo=info) == "bfloat16"


def test_explicit_dtypes_pass_through_and_unknown_ones_are_named():
    assert compute_dtype.resolve("bfloat16", cuda=False, cpuinfo=AVX2) == "bfloat16"
    with pytest.raises(ValueError, match="'int8'"):
        compute_dtype.resolve("int8")
    with pytest.raises(ValueError, match="EngineConfig.dtype"):
        EngineConfig(model="x", load_format="dummy", dtype="fp8")


def test_engine_args_and_kv_sizes_use_the_resolved_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(compute_dtype, "_this_host", lambda: (False, False))
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}')
    assert EngineConfig(model=str(tmp_path)).engine_args().dtype == "float32"
    assert kv_bytes_per_token(tmp_path, "auto") == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 2 * 2 * 2 * 16 * 2


def test_gpu_memory_utilization_reaches_vllm(tmp_path):
    """Several engines share one GPU only if each asks vLLM for a small free fraction at start; without
    one, an engine asks for the config's default (tests/test_settings_table.py)."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 64}')
    default = EngineConfig(model=str(tmp_path)).engine_args().gpu_memory_utilization
    assert EngineConfig(model=str(tmp_path), gpu_memory_utilization=0.05).engine_args().gpu_memory_utilization == 0.05
    assert default != 0.05
    with pytest.raises(ValueError, match="EngineConfig.gpu_memory_utilization"):
        EngineConfig(model=str(tmp_path), gpu_memory_utilization=1.5)
