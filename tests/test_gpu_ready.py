"""The routing kernels compiled for an H100/H200 (sm_90) by the pinned Triton wheel on this machine, no GPU
needed (kernels/tools/aot.py): every specialisation the model launches at the paper's widths compiles, spills
nothing, fits two programs per SM, and moves its tiles in 128-bit transfers. Two deliberately bad builds show
that the rules can fail. The compiler runs in a fresh process: the other kernel tests put Triton in
interpreter mode, which cannot compile."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json
from dataclasses import asdict
import triton.language as tl
from kernels.tools import aot
from kernels.launch import Launch

results = {d: [dict(asdict(c), problems=aot.check(c)) for c in compiled] for d, compiled in aot.compile_all().items()}

def bad(d, **config):
    # a forward over bf16 sources at width d with the given launch shape, as the launcher would bind it
    launch = next(l for l in aot.api_launches(1280) if l.kernel.fn.__name__ == "_route_fwd"
                  and l.args["A_DTYPE"] == tl.bfloat16)
    args = dict(launch.args, d=d, **config)
    (name, spec), = aot.specialisations([Launch(launch.kernel, 1, args, [], [])]).items()
    return aot.check(aot.compile_one(name, spec))

controls = {"odd width": bad(1283), "oversized tile": bad(4096, BLOCK_M=16, BLOCK_D=4096, num_warps=4)}
print(json.dumps({"results": results, "controls": controls}))
"""


@pytest.fixture(scope="module")
def compiled():
    from kernels.tools.aot import PTXAS
    if not os.path.exists(PTXAS):
        pytest.skip(f"this Triton wheel has no ptxas ({PTXAS}): cannot compile for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_every_model_specialisation_streams_at_the_paper_widths(compiled):
    results = compiled["results"]
    assert sorted(map(int, results)) == [768, 1024, 1280, 4096]
    for d, kernels in results.items():
        names = {k["name"].split()[0] for k in kernels}
        assert {"_route_fwd", "_route_bwd", "_group_fwd", "_group_bwd", "_receiver_fwd", "_receiver_bwd"} <= names
        for k in kernels:
            assert k["problems"] == [], (d, k["name"], k["problems"])
            assert k["spill_bytes"] == 0 and k["accesses"].get("128", 0) > 0


def test_the_rules_catch_element_wise_loads_and_spills(compiled):
    """A width the compiler cannot prove 16-byte aligned rows for reads bf16 element by element; a tile of
    16 rows x 4096 on 4 warps does not fit in registers."""
    controls = compiled["controls"]
    assert any("narrower than 32 bits" in p for p in controls["odd width"]), controls["odd width"]
    assert any(p.startswith("spills") for p in controls["oversized tile"]), controls["oversized tile"]
