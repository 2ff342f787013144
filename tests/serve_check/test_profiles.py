import pytest

from kimi_nvfp4.errors import DeviceError
from kimi_nvfp4.serve_check.gpu_fit import GpuInfo, check_gpu_fit, fit_problems, parse_nvidia_smi_csv, query_gpus
from kimi_nvfp4.serve_check.profiles import PROFILES, ProfileError, build_launch_command, get_profile, merge_flags


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_b200_tp4_command_has_the_spec_flags():
    cmd = build_launch_command(get_profile("b200-tp4"), "/ckpt", port=31000, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/ckpt"
    assert _flag(cmd, "--tp") == "4"
    assert _flag(cmd, "--port") == "31000"
    assert _flag(cmd, "--quantization") == "modelopt_fp4"
    assert _flag(cmd, "--moe-runner-backend") == "flashinfer_trtllm"
    assert _flag(cmd, "--attention-backend") == "trtllm_mla"
    assert _flag(cmd, "--kv-cache-dtype") == "fp8_e4m3"
    assert _flag(cmd, "--tool-call-parser") == "kimi_k2"
    assert _flag(cmd, "--reasoning-parser") == "kimi_k2"
    for f in ("--trust-remote-code", "--enable-cache-report", "--enable-metrics"):
        assert f in cmd
    assert "--disable-radix-cache" not in cmd


def test_h200_uses_marlin_and_w4a16():
    p = get_profile("h200")
    cmd = build_launch_command(p, "/ckpt")
    assert _flag(cmd, "--moe-runner-backend") == "marlin"
    assert "--attention-backend" not in cmd
    assert p.activations == "w4a16" and p.gpus.compute_caps == ("9.0",)


def test_extra_args_override_instead_of_duplicating():
    extra = ("--kv-cache-dtype", "auto", "--mem-fraction-static=0.85")
    cmd = build_launch_command(get_profile("b300-tp8"), "/m", extra_args=extra)
    assert cmd.count("--kv-cache-dtype") == 1 and _flag(cmd, "--kv-cache-dtype") == "auto"
    assert _flag(cmd, "--mem-fraction-static") == "0.85"


def test_naive_variant_disables_radix_cache_and_fp8_kv():
    cmd = build_launch_command(get_profile("b200-tp4-naive"), "/m")
    assert "--disable-radix-cache" in cmd and _flag(cmd, "--kv-cache-dtype") == "auto"


def test_unknown_profile_and_stray_value_are_errors():
    with pytest.raises(ProfileError, match="b200-tp4"):
        get_profile("b100")
    with pytest.raises(ProfileError, match="does not follow"):
        merge_flags([], ["value-without-flag"])


def test_parse_nvidia_smi_with_and_without_header_and_units():
    plain = "NVIDIA B200, 10.0, 183359\nNVIDIA B200, 10.0, 183359\n"
    assert parse_nvidia_smi_csv(plain) == [GpuInfo("NVIDIA B200", "10.0", 183359 / 1024)] * 2
    verbose = "name, compute_cap, memory.total [MiB]\nNVIDIA H200, 9.0, 143771 MiB\n"
    (g,) = parse_nvidia_smi_csv(verbose)
    assert g.compute_cap == "9.0" and round(g.memory_gib) == 140
    with pytest.raises(DeviceError, match="expected"):
        parse_nvidia_smi_csv("just one cell\n")


B200 = GpuInfo("NVIDIA B200", "10.0", 179.0)
H200 = GpuInfo("NVIDIA H200", "9.0", 140.4)


def test_fit_reports_every_missing_thing():
    problems = fit_problems(PROFILES["b200-tp4"], [H200] * 2, weight_gib=560)
    text = "; ".join(problems)
    assert "needs 4 GPUs, found 2" in text
    assert "compute capability 10.0 or 10.3" in text and "NVIDIA H200 (compute capability 9.0)" in text
    assert "exceed" in text  # 560 GiB of weights on 2x140 GiB
    with pytest.raises(DeviceError, match="b200-tp4 does not fit"):
        check_gpu_fit(PROFILES["b200-tp4"], [H200] * 2)


def test_fit_accepts_matching_machine_and_uses_first_gpus():
    assert check_gpu_fit(PROFILES["b200-tp4"], [B200] * 8, weight_gib=560) == [B200] * 4
    assert fit_problems(PROFILES["h200"], [H200] * 8, weight_gib=560) == []


def test_query_gpus_runs_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA B300, 10.3, 275040'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    (g,) = query_gpus()
    assert g.name == "NVIDIA B300" and g.compute_cap == "10.3"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    with pytest.raises(DeviceError, match="exit 9"):
        query_gpus()


def test_query_gpus_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DeviceError, match="not on PATH"):
        query_gpus()
