"""The geometries the served GPU benchmark runs (bench/device/shapes): each builds in mlx-lm's
own model classes with the parameter count of the model it stands for (less the vocabulary cut to
SmolLM2's 49,152 tokens), and a shaped folder gets the tokenizer it needs."""
import json

import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes as get_model_classes

from bench.device import shaped_models

# Published sizes, less (vocab - 49,152) x hidden for each embedding matrix the model has.
EXPECTED = {
    "smollm2-135m": 134_515_008,
    "llama-3.2-1b": 1_235_814_400 - (128_256 - 49_152) * 2048,
    "llama-3.1-8b": 8_030_261_248 - 2 * (128_256 - 49_152) * 4096,
}


def test_every_shape_is_listed():
    assert shaped_models.shape_names() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shape_builds_with_the_parameter_count_it_stands_for(name):
    config = json.loads((shaped_models.SHAPES / f"{name}.json").read_text())
    model_cls, args_cls = get_model_classes(config)
    model = model_cls(args_cls.from_dict(config))   # lazy: nothing is allocated until evaluated
    assert sum(v.size for _, v in tree_flatten(model.parameters())) == EXPECTED[name]
    assert config["vocab_size"] == 49_152 and config["torch_dtype"] == "bfloat16"


def test_source_folder_carries_config_and_tokenizer(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    src = shaped_models.source_folder("llama-3.1-8b", tok, tmp_path / "out")
    assert json.loads((src / "config.json").read_text())["num_hidden_layers"] == 32
    assert (src / "tokenizer.json").read_text() == "{}"


def test_a_folder_without_tokenizer_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        shaped_models.source_folder("smollm2-135m", tmp_path, tmp_path / "out")


def test_unknown_geometry_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        shaped_models.main(["llama-70b", "--tokenizer-from", str(tmp_path), "--out",
                            str(tmp_path)])
    assert "unknown geometry llama-70b" in capsys.readouterr().err
