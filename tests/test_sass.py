"""The machine-code reader (meters/sass.py), the speed model over it (meters/occupancy.py)
and the speed rule (meters/aot.speed_problems) on cases a hand count checks: a made-up SASS listing
of two nested loops, whose `for` statements are lines of a Python file written here."""
import pytest

from meters import aot, sass
from meters.occupancy import (CLOCK_HZ, COPY_BANDWIDTH, LATENCY_S, SCHEDULERS, SMS, Pass,
                                           launch_seconds, programs_resident)

KERNEL = '''def kernel(n, tiles, lo, hi):
    for t in tl.range(tiles):
        for i in tl.range(n, n + 2 * hi - lo):
            pass
'''


def listing(path: str) -> str:
    """Straight-line code, an outer loop (line 2) and an inner one (line 3), as nvdisasm -c -g prints them."""
    at = lambda line: f'\t//## File "{path}", line {line}\n'                         # noqa: E731
    return (at(1) + "        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;\n"
            "        /*0010*/               @!PT LDS RZ, [RZ] ;\n"
            ".L_x_1:\n" + at(2) +
            "        /*0020*/                   FADD R8, R4, R5 ;\n"
            ".L_x_2:\n" + at(3) +
            "        /*0030*/                   SHFL.BFLY PT, R9, R8, 0x1, 0x1f ;\n"
            "        /*0040*/                   STS [R10], R9 ;\n"
            "        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;\n"
            "        /*0060*/                   LDS.64 R12, [R10] ;\n"
            "        /*0070*/                   FADD R14, R12, R13 ;\n"
            "        /*0080*/                   STG.E desc[UR4][R2.64], R14 ;\n"
            "        /*0090*/               @P0 BRA `(.L_x_2) ;\n" + at(2) +
            "        /*00a0*/               @P1 BRA `(.L_x_1) ;\n"
            "        /*00b0*/                   EXIT ;\n"
            ".L_x_3:\n"
            "        /*00c0*/                   BRA `(.L_x_3);\n"
            "        /*00d0*/                   NOP;\n")


def test_loops_are_backward_branches_and_their_trips_are_the_python_ranges(tmp_path):
    path = tmp_path / "kernel.py"
    path.write_text(KERNEL)
    outside, outer, inner = sass.regions(listing(str(path)))
    # the never-true @!PT LDS, the NOP and the self-branch after EXIT are not a loop or an instruction
    assert outside.loop is None and outside.classes == {"load": 1, "other": 2} and outside.bytes == {"load": 16}
    assert outer.loop == (str(path), 2) and outer.classes == {"other": 2} and outer.enclosing == []
    assert inner.loop == (str(path), 3) and inner.enclosing == [(str(path), 2)]
    assert inner.classes == {"shuffle": 1, "shared": 2, "barrier": 1, "other": 2, "store": 1}
    assert inner.bytes == {"store": 4}
    args = dict(n=5, tiles=3, lo=1, hi=4)
    assert [sass.passes(r, args, str(path)) for r in (outside, outer, inner)] == [1, 3, 3 * (2 * 4 - 1)]
    with pytest.raises(ValueError, match="'hi' .* not an integer argument"):
        sass.passes(inner, dict(n=5, tiles=3, lo=1), str(path))


def test_line_records_of_code_another_checkout_compiled_are_read_from_this_one(tmp_path):
    """Triton's cache is keyed by the sources' hash, so a cached kernel's line records may name the folder of
    the checkout that compiled it first: the file is looked up by name beside the kernel."""
    path = tmp_path / "kernel.py"
    path.write_text(KERNEL)
    _, _, inner = sass.regions(listing("/gone/checkout/kernel.py"))
    assert sass.passes(inner, dict(n=5, tiles=3, lo=1, hi=4), str(path)) == 3 * (2 * 4 - 1)
    with pytest.raises(ValueError, match="names /gone/checkout/kernel.py, found neither"):
        sass.passes(inner, dict(n=5, tiles=3, lo=1, hi=4), str(tmp_path / "elsewhere" / "other.py"))


def test_a_loop_the_compiler_unrolled_runs_its_trips_over_the_unroll_and_the_rest_one_by_one(tmp_path):
    """Two loops closing line 3: one of 8 instructions (4 iterations a pass) and one of 2 (the remainder); 11
    trips are 2 passes of the first and 3 of the second."""
    path = tmp_path / "kernel.py"
    path.write_text(KERNEL)
    at = f'\t//## File "{path}", line 3\n'
    body = lambda n, label: "".join(f"        /*{16 * a:04x}*/                   FADD R8, R4, R5 ;\n"  # noqa: E731
                                     for a in range(n[0], n[0] + n[1])) + \
        f"        /*{16 * (n[0] + n[1]):04x}*/               @P0 BRA `({label}) ;\n"
    text = ".L_x_1:\n" + at + body((0, 7), ".L_x_1") + ".L_x_2:\n" + at + body((8, 1), ".L_x_2")
    _, main, rest = sass.regions(text)
    assert (main.instructions, main.unroll, rest.instructions, rest.remainder) == (8, 4, 2, 4)
    args = dict(n=0, tiles=1, lo=5, hi=8)                                     # 2 x 8 - 5 = 11 trips
    assert (sass.passes(main, args, str(path)), sass.passes(rest, args, str(path))) == (2, 3)


def test_one_warps_chain_waits_for_what_it_reads_and_at_barriers(tmp_path):
    """Inner loop, latencies {other 4, shuffle 30, shared 30, barrier 20, store 4}, 8 warps crowding the shared
    pipe at 1 cycle each: SHFL at 1 (R9 ready 1 + 30 + 8 = 39); STS reads R9: 39 (done 39 + 38 = 77); BAR waits
    for everything: 77, and the warp for it (to 97); LDS.64 at 97 (R12, R13 ready 97 + 30 + 2 x 8 = 143); FADD at
    143 (ready 147); STG at 147 (done 151); BRA at 148 (done 152): 152."""
    path = tmp_path / "kernel.py"
    path.write_text(KERNEL)
    inner = sass.regions(listing(str(path)))[2]
    latency = {"other": 4, "shuffle": 30, "shared": 30, "barrier": 20, "store": 4, "load": 1000, "mufu": 16,
               "wait": 4, "async": 4}
    assert sass.chain_cycles(inner, latency, crowd=8, pipe=1.0) == 152
    assert sass.chain_cycles(inner, latency, crowd=1, pipe=1.0) < 152


def test_a_launch_takes_the_largest_of_issue_latency_and_memory():
    """Two programs of 8 warps per SM: a pass of 1000 instructions issues in 1000 x 8 x 2 / 4 cycles, more than a
    chain of 3000; 264 programs are one round on 132 SMs; memory: bytes at the copy bandwidth."""
    assert programs_resident(registers=128, shared=0, num_warps=8) == 2      # 64K / (256 x 128)
    assert programs_resident(registers=255, shared=0, num_warps=8) == 1      # 256 registers allocated
    assert programs_resident(registers=32, shared=100 * 1024, num_warps=4) == 2
    p = Pass(passes=10, instructions=1000, latency_cycles=3000)
    t = launch_seconds([p], grid=2 * SMS, warps=8, resident=2, moved=0, in_flight=1)
    assert t["seconds"] == pytest.approx(10 * 1000 * 8 * 2 / SCHEDULERS / CLOCK_HZ) and t["bound"] == "issue"
    t = launch_seconds([p], grid=4 * SMS, warps=8, resident=1, moved=0, in_flight=1)
    assert t["rounds"] == 4 and t["bound"] == "latency" and t["seconds"] == pytest.approx(4 * 10 * 3000 / CLOCK_HZ)
    heavy = launch_seconds([p], grid=SMS, warps=8, resident=1, moved=10 ** 9, in_flight=1 << 20)
    assert heavy["bound"] == "memory" and heavy["seconds"] == pytest.approx(1e9 / COPY_BANDWIDTH)
    starved = launch_seconds([p], grid=SMS, warps=8, resident=1, moved=10 ** 9, in_flight=1024)
    assert starved["seconds"] == pytest.approx(1e9 / (SMS * 1024 / LATENCY_S))
    with pytest.raises(ValueError, match="no program"):
        launch_seconds([p], grid=SMS, warps=8, resident=0, moved=0, in_flight=1)


def test_the_speed_rule_wants_60_percent_of_copy_and_two_programs_unless_a_reason_is_stated(monkeypatch):
    k = dict(of_copy=0.7, programs_per_sm=2, bound="memory", instructions=100, barriers=2, grid=[264], resident=2)
    assert aot.speed_problems({"c": {"_k": k}}) == []
    slow, lonely = dict(k, of_copy=0.59), dict(k, programs_per_sm=1, resident=1)
    found = aot.speed_problems({"c": {"_slow": slow, "_lonely": lonely}})
    assert len(found) == 2 and "c _slow: predicted 59.0% of the copy bandwidth < 60%" in found[0]
    assert "c _lonely: 1 program(s) per SM < 2" in found[1]
    monkeypatch.setitem(aot.SPEED_REASONS, "_slow", "a stated reason")
    assert len(aot.speed_problems({"c": {"_slow": slow, "_lonely": lonely}})) == 1
