"""What a user's side-by-side measures (issue 30): prompts that never repeat across targets,
rates or repeats; lengths drawn from 25-400 tokens; exactly N Poisson arrivals per rate; output
tokens counted from the returned text with the model's tokenizer; llama.cpp's server as a target.
None of these needs a server: the real runs are the recorded benchmark."""
from __future__ import annotations

import itertools
import os

import pytest

from loadtest import arrivals, bench_serve, llama_peer, prompts, runner, scenarios
from loadtest.records import RequestRecord
from loadtest.tokens import TextCounter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "models", "orchard-tiny")


def _schedule(rate: float, n: int = 40, seed: int = 0) -> arrivals.Schedule:
    return scenarios.build("poisson", scenarios.Params(rate=rate, count=n, seed=seed,
                                                       prompt_range=(25, 400), context=8192))


def test_prompts_never_repeat_across_targets_rates_and_repeats():
    """Every replay the bench makes (3 targets x 3 rates x 2 repeats) sends texts no other
    replay sent, and no two prompts share their first words (a prefix cache would hit)."""
    cal = prompts.Calibration(tokens_per_word=1.3, overhead=4)
    replays = itertools.count()
    targets = ["orchard", "mlx_lm.server", "llama.cpp-f32"]
    texts, times = [], {}
    for rate in (1, 2, 4):
        base = _schedule(rate)
        for rep, target in bench_serve.replay_order(targets, repeats=2):
            s = base.reseeded(next(replays))
            # Equal work for every target: the same send times and prompt lengths.
            assert [(a.t, a.prompt_tokens) for a in s.arrivals] == \
                [(a.t, a.prompt_tokens) for a in base.arrivals]
            times.setdefault(rate, set()).add(tuple(a.t for a in s.arrivals))
            texts += [prompts.prompt_text(a.prompt_tokens, a.seed, cal) for a in s.arrivals]
    assert len(texts) == 3 * 3 * 2 * 40 == len(set(texts))
    heads = [" ".join(t.split()[:6]) for t in texts]
    assert len(set(heads)) == len(heads)
    assert all(len(v) == 1 for v in times.values())


def test_reseeding_is_reproducible():
    a, b = _schedule(2).reseeded(5), _schedule(2).reseeded(5)
    assert a.arrivals == b.arrivals and a.meta["replay"] == 5


def test_rate_sweep_schedule_has_exactly_n_arrivals_of_25_to_400_tokens():
    s = _schedule(2.0, n=40)
    lengths = [a.prompt_tokens for a in s.arrivals]
    assert len(s.arrivals) == 40 and s.arrivals[0].t == 0.0
    assert min(lengths) >= 25 and max(lengths) <= 400
    assert min(lengths) < 100 and max(lengths) > 300   # the draw spans the range
    assert s.meta["scaled_mix"] == [min(lengths), max(lengths)]
    # A small context caps the longest prompt so prompt + output still fit.
    small = scenarios.build("poisson", scenarios.Params(rate=2, count=40, prompt_range=(25, 400),
                                                        context=256))
    assert max(a.prompt_tokens for a in small.arrivals) <= int(256 * 0.9) - 64


def test_poisson_count_is_exact_and_rejects_nonsense():
    import random

    t = arrivals.poisson_count(4.0, 400, random.Random(1))
    assert len(t) == 400 and t == sorted(t)
    assert 0.2 < t[-1] / 399 < 0.3                    # mean gap 1/rate
    with pytest.raises(ValueError):
        arrivals.poisson_count(0, 10, random.Random(1))


def test_output_tokens_are_counted_from_the_text_with_the_tokenizer():
    counter = TextCounter(TINY)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(TINY, "tokenizer.json"))
    ids = tok.encode("The river ran past the old stone bridge, then", add_special_tokens=False).ids
    text = tok.decode(ids)
    assert counter.count(text) == len(ids) and counter.count("") == 0
    ok = RequestRecord(0, "poisson", 100, 64, 0.0, sent=0.0, status=200, done=1.0,
                       chunk_times=[0.5], output_tokens=64, usage_tokens=64, text=text)
    failed = RequestRecord(1, "poisson", 100, 64, 0.1, sent=0.1, status=500, done=0.2,
                           error="HTTP 500", text="")
    totals = counter.recount([ok, failed])
    assert ok.output_tokens == len(ids) and ok.tokens_from == "text"
    assert failed.output_tokens is None and failed.tokens_from == "usage"
    assert totals == {"from": "text", "tokenizer": counter.path, "text_total": len(ids),
                      "usage_total": 64}
    # The record survives its JSON round trip with the text and both counts.
    back = RequestRecord.from_dict(ok.to_dict())
    assert (back.text, back.output_tokens, back.usage_tokens) == (text, len(ids), 64)


def test_bench_serve_defaults_are_a_users_comparison():
    args = bench_serve.parser().parse_args(["--peer-url", "http://h:1"])
    assert args.prompt_tokens == (25, 400) and args.requests_per_rate == 40
    assert args.extra_body == '{"ignore_eos": true}' and not args.reuse_servers
    assert args.llama_model == [] and args.llama_slots == 16
    args = bench_serve.parser().parse_args(["--peer-url", "http://h:1", "--prompt-tokens",
                                            "10-20", "--tokenizer", TINY])
    assert args.prompt_tokens == (10, 20)
    assert args.tokenizer == os.path.join(TINY, "tokenizer.json")


@pytest.mark.parametrize("argv,message", [
    (["--prompt-tokens", "400-25"], "MIN <= MAX"),
    (["--prompt-tokens", "many"], "MIN-MAX"),
    (["--requests-per-rate", "0"], "positive"),
    (["--llama-model", "no-such.gguf"], "make llama-server"),
    (["--tokenizer", "/nonexistent-folder"], "no tokenizer"),
])
def test_bad_bench_serve_arguments_are_refused_clearly(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_serve.parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_llama_peer_settings_and_clear_errors(tmp_path):
    assert llama_peer.slot_context(400, 64) == 768
    assert llama_peer.slot_context(100, 16) == 256
    gguf = tmp_path / "SmolLM2-135M-Instruct.F32.gguf"
    gguf.write_bytes(b"GGUF")
    assert llama_peer.gguf_path(str(gguf)) == str(gguf)
    assert llama_peer.label(str(gguf)) == "llama.cpp-f32"
    assert llama_peer.label("x/SmolLM2-135M-Instruct.Q4_1.gguf") == "llama.cpp-q4_1"
    with pytest.raises(ValueError, match="make llama-server"):
        llama_peer.start(str(gguf), str(tmp_path / "log"), binary=str(tmp_path / "missing"))


def test_runner_keeps_its_old_defaults():
    """`loadtest run` still cycles the --mix unless --prompt-tokens is given."""
    args = runner.parser().parse_args(["--host", "http://h:1"])
    assert args.prompt_tokens is None and args.tokenizer is None
    p = runner.params_from(args, 4096, None)
    assert p.prompt_range is None and p.count is None


def test_model_names_without_the_product():
    """loadtest's own short-name table (it may not import engine.model.names)."""
    from loadtest import models

    assert models.served_id("smollm2") == "smollm2-135m" == models.served_id("smollm2-135m")
    assert models.served_id("/some/path") == "/some/path"
    assert models.model_dir("orchard-tiny") == TINY
    assert models.weight_bytes(TINY, 4) > 0
    with pytest.raises(ValueError, match="config.json"):
        models.model_dir("/no/such/model")
