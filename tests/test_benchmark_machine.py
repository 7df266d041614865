"""benchmarks/_machine.py: every benchmark's JSON names the CPU it ran on (model, AVX-512/AMX/AVX2) and the
XLA flags in effect. Cheap: no benchmark runs; `lscpu` is the oracle for this machine's cpuinfo."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import _machine  # noqa: E402

# A Sapphire Rapids guest's cpuinfo (abridged): AMX and AVX-512-BF16 present, two processors.
INTEL_FLAGS = "fpu sse sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16"
INTEL = f"""processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: {INTEL_FLAGS} amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def _lscpu() -> dict[str, str]:
    if not shutil.which("lscpu"):
        pytest.skip("no lscpu here")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, env={"LC_ALL": "C"}).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}


def test_reads_this_machines_cpu_as_lscpu_does():
    lscpu = _lscpu()
    info = _machine.machine()
    assert info["cpu_model"] == lscpu["Model name"]
    flags = set(lscpu["Flags"].split())
    assert info["isa"] == {f: f in flags for f in _machine.ISA_FLAGS}
    assert info["cores"] >= 1
    line = _machine.header(info)
    assert lscpu["Model name"] in line
    assert all(f in line for f in _machine.ISA_FLAGS if f in flags)


def test_parses_an_intel_amx_cpuinfo_and_the_first_processor_only():
    info = _machine.parse_cpuinfo(INTEL)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert info["isa"]["amx_bf16"] and info["isa"]["amx_tile"] and info["isa"]["avx512_bf16"]
    assert info["isa"]["avx2"] and info["isa"]["avx512f"]
    amd = _machine.parse_cpuinfo(INTEL.replace(" amx_bf16 amx_tile amx_int8", ""))
    assert not amd["isa"]["amx_bf16"] and not amd["isa"]["amx_tile"] and amd["isa"]["avx512_bf16"]


def test_records_the_xla_flags_in_effect(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_onednn=true")
    info = _machine.machine()
    assert info["xla_flags"]["env"] == "--xla_cpu_use_onednn=true"
    assert "--xla_cpu_use_onednn=true" in _machine.header(info)
    # a benchmark whose workers run under other flags records theirs
    assert _machine.machine("--xla_force_host_platform_device_count=1")["xla_flags"]["env"] == (
        "--xla_force_host_platform_device_count=1"
    )


def _machine_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "_machine"
    ]


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")))
def test_every_benchmark_json_and_header_carry_the_machine(script):
    """Each benchmark puts `_machine.machine()` under the key "machine" of the JSON it writes (mini_paper:
    spread into its summary's machine record) and prints `_machine.header()`."""
    tree = ast.parse((BENCH / script).read_text())
    calls = _machine_calls(tree)
    assert any(c.func.attr == "machine" for c in calls), f"{script}: no _machine.machine() in its JSON"
    if script == "mini_paper.py":
        return  # its header line prints the machine record it writes to summary.json
    assert any(c.func.attr == "header" for c in calls), f"{script}: no _machine.header() printed"
    keyed = [
        v
        for d in ast.walk(tree)
        if isinstance(d, ast.Dict)
        for k, v in zip(d.keys, d.values, strict=True)
        if isinstance(k, ast.Constant) and k.value == "machine"
    ]
    # the call itself, or a name bound to it (one record printed in the header and written to the JSON)
    bound = {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and n.value in calls
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert any(v in calls or (isinstance(v, ast.Name) and v.id in bound) for v in keyed), (
        f"{script}: the JSON has no 'machine' key from _machine.machine()"
    )


def test_mini_paper_summary_machine_has_the_isa():
    import mini_paper

    info = mini_paper.machine()
    assert info["cpu_model"] == _machine.machine()["cpu_model"]
    assert set(info["isa"]) == set(_machine.ISA_FLAGS) and "xla_flags" in info
