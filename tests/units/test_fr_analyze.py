"""fr_analyze's report names the algorithm each recorded collective ran with."""

from __future__ import annotations

from neuron_dist.fr_analyze import analyse


def _rec(rank, seq, state, algo, **kw):
    rec = {"group": "0", "rank": rank, "size": 2, "seq": seq, "op": "all_reduce",
           "call": "all_reduce(float32, 4 elements, SUM)", "state": state, "t_issue": 1.0,
           "t_start": 2.0, "t_end": None, "error": None, **kw}
    if algo is not ...:  # ...: a dump written before records had the field
        rec["algo"] = algo
    return rec


def test_rank_lines_name_the_algorithm():
    docs = [{"records": [_rec(0, 1, "completed", "halves+ring"),
                         _rec(0, 2, "failed", "one_step", error="PeerTimeoutError: x")]},
            {"records": [_rec(1, 1, "completed", None), _rec(1, 2, "running", ...)]}]
    lines, problem = analyse(docs)
    text = "\n".join(lines)
    assert ("rank 0: last completed #1 all_reduce(float32, 4 elements, SUM) [algo halves+ring]; "
            "FAILED in #2 all_reduce(float32, 4 elements, SUM) [algo one_step]: "
            "PeerTimeoutError: x") in text, text
    # no algorithm recorded (None, or a dump from before the field): the call alone
    assert ("rank 1: last completed #1 all_reduce(float32, 4 elements, SUM); "
            "running #2 all_reduce(float32, 4 elements, SUM) (issued at 2.000)") in text, text
    assert "[algo None]" not in text and not problem
