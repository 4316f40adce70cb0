"""bench.compiled_check on the CPU: compiled and uncompiled steps agree over the same pages."""
import json

import pytest

from bench import compiled_check


def test_compiled_and_plain_sides_agree(tmp_path):
    out = tmp_path / "c.json"
    compiled_check.main(["--batches", "2", "--steps", str(compiled_check.WARM_STEPS + 2),
                         "--prompt", "20", "--out", str(out)])
    (point,) = json.loads(out.read_text())["batches"]
    assert point["greedy_tokens_equal"] and point["traces"] == 1
    # float32 on the CPU: the two paths sum in different orders, so close, not bit-identical
    assert point["max_abs_logit_diff"] < 1e-3 and point["pages_max_abs_diff"] < 1e-3


def test_interleaved_tables_never_share_a_page():
    tables = compiled_check.interleaved_tables(3, 4)
    pages = [p for row in tables for p in row]
    assert len(set(pages)) == 12 and tables[0][:2] == [0, 3]


def test_too_few_steps_are_refused(capsys):
    with pytest.raises(SystemExit):
        compiled_check.parse_args(["--steps", str(compiled_check.WARM_STEPS)])
    assert "--steps" in capsys.readouterr().err
