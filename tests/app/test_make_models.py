"""benchmarks/models/make_models.py: a tiny Llama-shaped directory, written shard by shard, loads through
``transformers.AutoModelForCausalLM.from_pretrained`` with no missing or unexpected key, and every
tensor the model holds is the one written. The real sizes (1B, 3B, 8B) use the same code."""

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")


@pytest.fixture
def make_models(benchmark_script):
    return benchmark_script("make_models")


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_model_loads_with_every_tensor_as_written(make_models, tmp_path, tied):
    shape = replace(make_models.SHAPES["tiny"], tied=tied)
    out = tmp_path / "llama"
    done = make_models.write_model(str(out), shape, seed=3, max_shard_size="100KB", log=lambda line: None)
    assert not (tmp_path / "llama.partial").exists()
    assert len(done["files"]) > 1  # sharded, with an index naming every tensor
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = dict(make_models.tensors(shape))
    assert set(index["weight_map"]) == set(expected) and ("lm_head.weight" in expected) == (not tied)
    assert set(index["weight_map"].values()) == set(done["files"])
    assert index["metadata"]["total_size"] == done["bytes"] == 2 * sum(torch.Size(s).numel() for s in expected.values())

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert isinstance(model, transformers.LlamaForCausalLM)
    state = model.state_dict()
    for name, size in expected.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], make_models.tensor_for(name, size, seed=3)), name
    weights = [state[n] for n in expected if n.endswith("proj.weight")]
    assert all(abs(float(w.float().std()) - make_models.STD) < 0.002 for w in weights)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (shape.layers, shape.hidden, shape.intermediate, shape.heads,
                                                         shape.kv_heads, shape.vocab)
    assert cfg.rope_parameters["rope_theta"] == 500000.0

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("The river ran past the mill, 2048 tokens.")["input_ids"]
    assert len(tokenizer) <= shape.vocab and max(ids) < len(tokenizer)
    assert tokenizer.decode(ids) == "The river ran past the mill, 2048 tokens."
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    with torch.no_grad():
        out_ids = model.generate(torch.tensor([ids]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        logits = model(out_ids).logits
    assert out_ids.shape == (1, len(ids) + 4) and torch.isfinite(logits).all()


def test_real_shapes_match_the_published_configs(make_models):
    """Parameter counts of the published models (tied heads counted once)."""
    counts = {name: sum(torch.Size(s).numel() for _, s in make_models.tensors(shape))
              for name, shape in make_models.SHAPES.items()}
    assert counts["1b"] == 1_235_814_400
    assert counts["3b"] == 3_212_749_824
    assert counts["8b"] == 8_030_261_248
    assert make_models.SHAPES["8b"].tied is False and make_models.SHAPES["1b"].head_dim == 64


def test_shards_split_as_save_pretrained_does(make_models):
    entries = [("a", (10,)), ("b", (100,)), ("c", (10,)), ("d", (10,))]  # bf16: 20, 200, 20, 20 bytes
    assert [[n for n, _ in s] for s in make_models.shards(entries, 50)] == [["a"], ["b"], ["c", "d"]]
    assert make_models.parse_size("2GB") == 2 * 10**9 and make_models.parse_size("100KB") == 100_000


def test_an_existing_directory_is_refused(make_models, tmp_path):
    with pytest.raises(FileExistsError):
        make_models.write_model(str(tmp_path), "tiny", log=lambda line: None)


@pytest.mark.slow
@pytest.mark.parametrize("architectures", [True, False], ids=["with-architectures", "auto-class"])
def test_a_2_4_stand_in_loads_packed_as_deployed(make_models, tmp_path, architectures):
    import nmcompile
    from nmcompile.deploy import load_pretrained

    out = tmp_path / "tiny24"
    make_models.write_model(str(out), "tiny", nm24=True, log=lambda line: None)
    if not architectures:  # a config without them: load_pretrained builds through AutoModelForCausalLM
        config = json.loads((out / "config.json").read_text())
        config.pop("architectures")
        (out / "config.json").write_text(json.dumps(config))
    packed, dense = load_pretrained(out, packed=True), load_pretrained(out)
    report = nmcompile.check(packed)
    assert report.ok and len(report) == 7 * make_models.SHAPES["tiny"].layers
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits)
