"""A short run of soak/config_fuzz.py in the suite: generated configs through every source, valid and invalid, never
end in a traceback (the full run is 1,000 cases; its figures are in the closing note of the reliability issue)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "soak"))
from config_fuzz import make_case, run_case  # noqa: E402


def test_generated_configs_run_or_get_a_clear_error(tmp_path):
    rng = random.Random(7)
    outcomes = {"ran": 0, "clear error": 0, "other error": 0, "traceback": 0}
    tracebacks = []
    for i in range(80):
        case = make_case(rng, tmp_path, i)
        outcome, text = run_case(case)
        outcomes[outcome] += 1
        if outcome == "traceback":
            tracebacks.append((case["argv"], case["env"], text[-800:]))
    assert tracebacks == []
    # The generator makes both kinds: the check above would pass vacuously on a generator that made no bad values.
    assert outcomes["ran"] >= 5 and outcomes["clear error"] >= 20, outcomes
