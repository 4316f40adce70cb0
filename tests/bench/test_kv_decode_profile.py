"""bench.kv_decode_profile: each format's host time a step is its own profile's, and the
difference to native names the functions only that format's step calls."""
import json

import pytest

from bench import kv_decode_profile


def test_page_key_steps_are_profiled_apart_from_native(tmp_path):
    out = tmp_path / "prof.json"
    kv_decode_profile.main(["--context", "200", "--batch", "2", "--page-tokens", "64",
                            "--formats", "k6v4-kivi", "--steps", "4", "--rounds", "2",
                            "--top", "40", "--out", str(out)])
    got = json.loads(out.read_text())["formats"]
    assert list(got) == ["native", "k6v4-kivi"]
    for row in got.values():
        assert row["profiled_ms_a_step"] > 0 and len(row["round_ms_a_step"]) == 2
    native_names = {n for n, _ in got["native"]["top_own_ms_a_step"]}
    diff = {n: (f, nat) for n, f, nat in got["k6v4-kivi"]["against_native"]}
    # The page-key store's CPU decode runs in its step only, never in native's.
    page_key = [n for n in diff if n.startswith("cpu_page_key_decode.py")]
    assert page_key and all(diff[n][0] > 0 == diff[n][1] for n in page_key)
    assert not any(n.startswith("cpu_page_key_decode.py") for n in native_names)
    assert "against_native" not in got["native"]


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--page-tokens", "48"], ["--batch", "0"]])
def test_bad_arguments_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        kv_decode_profile.main(bad)
    assert "error" in capsys.readouterr().err
