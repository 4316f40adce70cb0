"""bench.mixed_step: times a mixed step merged and per group, with its halves, as JSON."""
import json

import pytest

from bench import mixed_step


def test_times_every_variant_of_each_step(tiny_llama, tmp_path):
    out = tmp_path / "mix.json"
    mixed_step.main(["--model", tiny_llama, "--prompts", "9", "--prompts", "12,5", "--rows", "3",
                     "--context", "20", "--repeats", "2", "--out", str(out)])
    got = json.loads(out.read_text())
    assert [s["prompts"] for s in got["steps"]] == [[9], [12, 5]]
    for step in got["steps"]:
        assert set(step["median_s"]) == {"merged", "per_group", "decode_alone", "prompts_alone"}
        assert all(len(v) == 2 and min(v) > 0 for v in step["rounds_s"].values())
        assert step["merged_to_per_group"] > 0


@pytest.mark.parametrize("bad", [["--prompts", "0"], ["--prompts", "a,b"], ["--rows", "0"]])
def test_bad_arguments_are_refused_naming_them(bad, capsys):
    with pytest.raises(SystemExit):
        mixed_step.parse_args(["--model", "smollm2", *bad])
    assert bad[0] in capsys.readouterr().err
