"""bench.greedy_agreement's verdicts: a divergence counts as a near tie only when mlx-lm's two best
logits at that position are within one bfloat16 step; anything wider is reported as not a tie."""
from bench.greedy_agreement import bf16_step, judge, parse_args
from engine.sampling.params import TokenLogprob


def test_bf16_step_is_the_spacing_of_bfloat16_at_that_magnitude():
    assert bf16_step(1.0) == 2 ** -7
    assert bf16_step(-20.0) == 2 ** -3     # 16 <= 20 < 32: 8 significant bits
    assert bf16_step(0.75) == 2 ** -8


def test_agreeing_tokens_have_no_divergence():
    r = judge([1, 2, 3], [(5.0, 1.0)] * 3, [1, 2, 3], [])
    assert r == {"agree": True, "tokens": 3}


def test_a_divergence_at_a_tie_is_a_near_tie_and_records_the_engine_gap():
    lps = [TokenLogprob(-0.1), TokenLogprob(-0.7, ((9, -0.7), (4, -0.71)))]
    r = judge([1, 4, 5], [(5.0, 1.0), (20.0, 20.0 - 2 ** -3)], [1, 9, 6], lps)
    assert (r["agree"], r["first_divergence"], r["ref_token"], r["engine_token"]) == (False, 1, 4, 9)
    assert r["near_tie"] is True
    assert r["engine_top2_logprob_gap"] == 0.01


def test_a_divergence_with_a_clear_winner_is_not_a_tie():
    r = judge([1, 4], [(5.0, 1.0), (20.0, 19.0)], [1, 9], [])
    assert r["near_tie"] is False and r["ref_top2_gap"] == 1.0


def test_arguments_are_checked():
    import pytest
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "0"])


def test_noise_floor_fuses_the_reference_and_judges_it_by_the_same_rule():
    """On the embedded model: fused mlx-lm (another summation order, the same weights) against
    plain mlx-lm's tokens; a planted reference token shows up as a judged divergence."""
    from mlx_lm import load

    from bench.greedy_agreement import noise_floor, reference
    from engine.model.names import resolve_model
    model, tok = load(str(resolve_model("orchard-tiny")))
    prompts = [tok.encode("hello there"), tok.encode("one two three")]
    refs = [reference(model, p, 6) for p in prompts]
    planted = (refs[1][0][:3] + [refs[1][0][3] + 1] + refs[1][0][4:], refs[1][1])
    got = noise_floor(model, prompts, [refs[0], planted], 6)
    assert got["fused_modules"] > 0
    assert got["rows"][0]["agree"] is True
    assert got["rows"][1]["first_divergence"] == 3 and got["agree"] == 1


def test_a_side_names_its_format_and_engine_fields():
    import pytest

    from bench.greedy_agreement import engine_side
    assert engine_side("int8") == ("int8", {}, {})
    assert engine_side("native+prefill_attention=fast+max_step_tokens=512") == (
        "native", {"prefill_attention": "fast", "max_step_tokens": "512"}, {})
    assert engine_side("native+kernel.decode_kernel=false+kernel.native_decode=walk") == (
        "native", {}, {"decode_kernel": False, "native_decode": "walk"})
    with pytest.raises(SystemExit, match="FORMAT\\+KEY=VALUE"):
        engine_side("native+fast")


def test_an_unknown_engine_field_is_refused_before_any_decoding(monkeypatch):
    import argparse

    import pydantic
    import pytest

    from bench import greedy_agreement
    monkeypatch.setattr("mlx_lm.load", lambda *a, **k: pytest.fail("loaded before checking"))
    with pytest.raises(pydantic.ValidationError, match="no_such_knob"):
        greedy_agreement.run(parse_args(["--model", "orchard-tiny",
                                         "--formats", "native,native+no_such_knob=1"]))
    with pytest.raises(argparse.ArgumentTypeError, match="no_such_kernel"):
        greedy_agreement.run(parse_args(["--model", "orchard-tiny",
                                         "--formats", "native+kernel.no_such_kernel=1"]))
    with pytest.raises(pydantic.ValidationError, match="max_step_tokens"):
        greedy_agreement.run(parse_args(["--model", "orchard-tiny",
                                         "--formats", "native+max_step_tokens=many"]))


def test_engine_fields_arrive_typed(monkeypatch):
    """Text values become the config's types (an int, a bool) on the engine each side runs."""
    from bench import greedy_agreement
    seen = []

    class Stop(Exception):
        pass

    def engine(config, kernels):
        seen.append((config, kernels))
        raise Stop
    monkeypatch.setattr("engine.Engine", engine)
    import pytest
    with pytest.raises(Stop):
        greedy_agreement.run(parse_args([
            "--model", "orchard-tiny", "--prompts", "1", "--tokens", "1", "--formats",
            "native+max_step_tokens=256+compiled_decode=false+kernel.decode_kernel=false"]))
    (config, kernels), = seen
    assert config.max_step_tokens == 256 and config.compiled_decode is False
    assert kernels.decode_kernel is False and config.max_num_seqs == 1
