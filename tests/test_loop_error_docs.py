"""The docs say what a cooperative loop's exception does by default (issue 53, item 7): ``cluster.loop_error``
defaults to ``lose_rank`` (the survivors recover, as in the reference), so no page or docstring may say the run
ends FAILED without naming ``loop_error``."""
from __future__ import annotations

import re

from flodl_exp.config import ClusterConfig

from conftest import ROOT

PLACES = ["docs/concepts/cooperative.md", "flodl_exp/rank/cooperative.py", "flodl_exp/protocol/messages.py", "README.md"]


def test_the_default_is_a_lost_rank_and_every_place_that_says_failed_names_loop_error() -> None:
    assert ClusterConfig().loop_error == "lose_rank"
    for rel in PLACES:
        text = (ROOT / rel).read_text()
        paragraphs = re.split(r"\n\s*\n|\n- ", text)
        for par in paragraphs:
            flat = " ".join(par.split())
            if re.search(r"exception[^.]*loop[^.]*(ends the run FAILED|the run ends FAILED)", flat):
                assert "loop_error" in flat, f"{rel}: says a loop exception ends the run FAILED without loop_error: {flat[:300]}"
