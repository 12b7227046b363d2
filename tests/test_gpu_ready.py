"""The routing kernels compiled for an H100/H200 (sm_90) by the pinned Triton wheel on this machine, no GPU
needed (depth_kernels/tools/aot.py): every specialisation the model launches at the paper's widths compiles, spills
nothing, fits its programs per SM, moves its tiles in 128-bit transfers, and keeps enough bytes in flight
with few masked lanes (or a stated reason covers it). Five deliberately bad builds show that the rules can
fail. The compiler runs in a fresh process: the other kernel tests put Triton in
interpreter mode, which cannot compile."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json
import os
from dataclasses import asdict
import triton.language as tl
from depth_kernels.tools import aot
from depth_kernels.launch import Launch

results = {d: [dict(asdict(c), problems=aot.check(c)) for c in compiled]
           for d, compiled in aot.compile_all(jobs=os.cpu_count()).items()}

def bad(d, kernel="_route_fwd", launches=aot.api_launches(1280), **config):
    # a launch of `kernel` over bf16 sources at width d with the given launch shape, as the launcher would bind it
    launch = next(l for l in launches if l.kernel.fn.__name__ == kernel and l.args["A_DTYPE"] == tl.bfloat16)
    args = dict(launch.args, d=d, **config)
    (name, spec), = aot.specialisations([Launch(launch.kernel, 1, args, launch.reads, launch.writes)]).items()
    return aot.check(aot.compile_one(name, spec))

controls = {"odd width": bad(1283), "oversized tile": bad(4096, BLOCK_M=16, BLOCK_D=4096, BLOCK_T=0, num_warps=4),
            "padded row": bad(2048, BLOCK_M=1, BLOCK_D=4096, BLOCK_T=0),
            "unsplit row": bad(1280, BLOCK_D=2048, BLOCK_T=0),
            "shallow pipeline": bad(4096, "_group_fwd", aot.model_launches(4096), STAGES=1)}
print(json.dumps({"results": results, "controls": controls}))
"""


@pytest.fixture(scope="module")
def compiled():
    from depth_kernels.tools.aot import PTXAS
    if not os.path.exists(PTXAS):
        pytest.skip(f"this Triton wheel has no ptxas ({PTXAS}): cannot compile for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_every_model_specialisation_streams_at_the_paper_widths(compiled):
    results = compiled["results"]
    assert sorted(map(int, results)) == [768, 1024, 1280, 2048, 4096]
    for d, kernels in results.items():
        names = {k["name"].split()[0] for k in kernels}
        assert {"_route_fwd", "_route_bwd", "_group_fwd", "_group_bwd", "_receiver_fwd", "_receiver_bwd"} <= names
        for k in kernels:
            assert k["problems"] == [], (d, k["name"], k["problems"])
            assert k["spill_bytes"] == 0 and k["accesses"].get("128", 0) > 0


def test_the_rules_catch_element_wise_loads_spills_padding_and_a_shallow_pipeline(compiled):
    """A width the compiler cannot prove 16-byte aligned rows for reads bf16 element by element; a tile of
    16 rows x 4096 on 4 warps does not fit in registers; a 2048-wide row in a 4096-lane tile wastes half of
    every row operation (a power of two: no stated reason covers it), and a 1280-wide row in one 2048-lane tile,
    not split, 37.5% (a third or more: no reason covers it either); phase 1's forward with one stage keeps one
    8 KB row in flight per SM."""
    controls = compiled["controls"]
    assert any("narrower than 32 bits" in p for p in controls["odd width"]), controls["odd width"]
    assert any(p.startswith("spills") for p in controls["oversized tile"]), controls["oversized tile"]
    assert any("50.0% of lanes masked" in p for p in controls["padded row"]), controls["padded row"]
    assert any("37.5% of lanes masked" in p for p in controls["unsplit row"]), controls["unsplit row"]
    assert any("KB in flight per SM < 16 KB" in p for p in controls["shallow pipeline"]), controls["shallow pipeline"]


def test_occupancy_at_the_paper_widths(compiled):
    """Every specialisation keeps >= 16 KB in flight per SM with <= 20% of lanes masked, or a stated reason
    covers it (aot.stated_reason); phase 1's backward, whose loads the pipeline carries, needs no reason for
    bytes in flight at any width, nor its forward at the 1044M width and above, nor a receiver's backward whose
    row loop is pipelined (no sources of its own, no slots to sum: every receiver of the block methods but a
    block's first)."""
    for d, kernels in compiled["results"].items():
        for k in kernels:
            name = k["name"]
            pipelined_rows = name.startswith("_receiver_bwd") and "HAS_TABLE=False" in name and "SUMS=False" in name
            if name.startswith("_group_bwd") or (name.startswith("_group_fwd") and int(d) > 1024) or pipelined_rows:
                assert k["occupancy"]["bytes_in_flight"] >= 16 * 1024, (d, name, k["occupancy"])
            if pipelined_rows:
                assert "ROW_STAGES=1 " not in name, name
            if int(d) & (int(d) - 1) == 0:
                assert k["occupancy"]["masked"] == 0, (d, k["name"])
            assert k["occupancy"]["masked"] < 1 / 3, (d, name)      # split rows: never a third of a row
            if int(d) == 1280:
                assert "BLOCK_T=256 " in name or "BLOCK_T=512 " in name, name
                assert k["occupancy"]["masked"] <= 0.2, name
