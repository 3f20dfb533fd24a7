"""The gpt-stdlib recipe: codec, corpus, dataset, model, loss protocol, sampling, config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hookloop.config import Config, apply_overrides
from hookloop.recipes import RecipeParts, gpt
from hookloop.recipes.gpt import (
    GPT,
    VOCAB_SIZE,
    ByteWindows,
    GPTConfig,
    TextDataConfig,
    decode,
    encode,
    flops_per_sample,
    forward_step,
    generate,
    load_corpus,
    split_corpus,
)

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0)


def tiny_model(seed: int = 0, **changes: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(TINY, **changes))


def test_encode_decode_round_trips_non_ascii_text() -> None:
    text = "naïve café — 日本語 🐍\n\tdef f(): return 'ok'"
    ids = encode(text)
    assert ids.dtype in (torch.uint8, torch.long)
    assert ids.numel() == len(text.encode("utf-8"))
    assert int(ids.max()) < VOCAB_SIZE
    assert decode(ids) == text
    assert decode(ids.tolist()) == text


def test_decode_replaces_invalid_utf8_instead_of_raising() -> None:
    assert decode([0xE6, 0x97]) == "\ufffd"  # half of a 3-byte character


def test_dataset_targets_are_inputs_shifted_by_one_byte() -> None:
    data = bytes(range(256)) * 4
    ds = ByteWindows(data, block_size=10)
    assert len(ds) == (len(data) - 1) // 10
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.long
        assert x.shape == y.shape == (10,)
        assert torch.equal(x[1:], y[:-1])
        start = i * 10
        assert x.tolist() == list(data[start : start + 10])
        assert y.tolist() == list(data[start + 1 : start + 11])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_train_and_eval_splits_share_no_bytes() -> None:
    # Each byte position is tagged by its own value modulo 251 (prime), so overlap would show.
    corpus = bytes(i % 251 for i in range(5_000))
    train, held = split_corpus(corpus, block_size=8, eval_fraction=0.2)
    assert len(train) > 0 and len(held) > 0
    train_end = train.data.numel()
    assert train_end == int(5_000 * 0.8)
    assert held.data.numel() == 5_000 - train_end
    # Every training window (including its look-ahead byte) lies inside the head.
    last = len(train) - 1
    assert last * 8 + 8 + 1 <= train_end
    assert bytes(held.data.tolist()) == corpus[train_end:]


def test_stdlib_corpus_is_deterministic_and_is_python_source() -> None:
    a = load_corpus("stdlib", 300_000)
    b = load_corpus("stdlib", 300_000)
    assert a == b
    assert len(a) == 300_000
    assert a.count(b"def ") > 100 and a.count(b"import ") > 20


def test_missing_source_path_gives_clear_error(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"data\.source.*does not exist"):
        load_corpus(missing, 1_000)
    cfg = TextDataConfig(source=missing)
    with pytest.raises(ValueError, match=r"data\.source"):
        cfg.validate()


def test_directory_and_file_sources_are_read_in_sorted_order(tmp_path) -> None:
    (tmp_path / "b.py").write_text("bbb\n")
    (tmp_path / "a.py").write_text("aaa\n")
    (tmp_path / "notes.txt").write_text("ignored\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("ccc")
    assert load_corpus(str(tmp_path), 1_000) == b"aaa\nbbb\nccc\n"
    assert load_corpus(str(tmp_path), 6) == b"aaa\nbb"
    assert load_corpus(str(tmp_path / "notes.txt"), 1_000) == b"ignored\n"


def test_logits_have_shape_batch_time_vocab() -> None:
    model = tiny_model()
    idx = torch.randint(0, VOCAB_SIZE, (3, TINY.block_size))
    assert model(idx).shape == (3, TINY.block_size, VOCAB_SIZE)
    assert model(idx[:, :5]).shape == (3, 5, VOCAB_SIZE)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_model_is_causal_later_tokens_do_not_change_earlier_logits() -> None:
    model = tiny_model().eval()
    idx = torch.randint(0, VOCAB_SIZE, (2, TINY.block_size))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB_SIZE
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_lm_head_is_tied_and_parameters_are_counted_once() -> None:
    model = tiny_model()
    assert model.head.weight is model.tok_emb.weight
    n = model.num_params()
    assert n == gpt.count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert model.num_params(exclude_embeddings=True) == n - TINY.block_size * TINY.n_embd
    t = TINY.block_size
    expected = 6 * n * t + 12 * TINY.n_layer * t * t * TINY.n_embd
    assert flops_per_sample(TINY, n) == expected


def test_fresh_model_predicts_near_uniform_bytes() -> None:
    model = tiny_model()
    x, y = torch.randint(0, VOCAB_SIZE, (2, 4, TINY.block_size))
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB_SIZE), y.reshape(-1))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_loss_func_returns_token_sum_count_and_mean() -> None:
    model = tiny_model()
    x, y = torch.randint(0, VOCAB_SIZE, (2, 3, TINY.block_size))
    output, loss_func = forward_step(None, iter([(x, y)]), model)
    assert output.shape == (3, TINY.block_size, VOCAB_SIZE)
    loss_sum, num_tokens, metrics = loss_func(output)
    assert loss_sum.dim() == 0 and loss_sum.requires_grad
    assert torch.is_tensor(num_tokens) and int(num_tokens) == 3 * TINY.block_size
    mean = F.cross_entropy(output.reshape(-1, VOCAB_SIZE), y.reshape(-1))
    assert torch.allclose(loss_sum / num_tokens, mean, atol=1e-5)
    assert set(metrics) == {"lm loss"}
    assert not metrics["lm loss"].requires_grad
    assert torch.allclose(metrics["lm loss"], mean, atol=1e-5)


def test_a_few_optimizer_steps_lower_the_loss_on_a_tiny_corpus() -> None:
    torch.manual_seed(0)
    text = b"def add(a, b):\n    return a + b\n\n" * 40
    ds = ByteWindows(text, TINY.block_size)
    model = tiny_model()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True)

    def full_loss() -> float:
        with torch.no_grad():
            out, loss_func = forward_step(None, iter(loader), model)
            loss_sum, n, _ = loss_func(out)
        return (loss_sum / n).item()

    before = full_loss()
    for _ in range(8):
        for batch in loader:
            out, loss_func = forward_step(None, iter([batch]), model)
            loss_sum, n, _ = loss_func(out)
            optim.zero_grad()
            (loss_sum / n).backward()
            optim.step()
    after = full_loss()
    assert before > 5.0
    assert after < before - 1.5


def test_generate_returns_the_continuation_and_restores_train_mode() -> None:
    model = tiny_model().train()
    out = generate(model, "def ", 20, generator=torch.Generator().manual_seed(0))
    assert isinstance(out, str)
    # 20 bytes decode to at most 20 characters (multi-byte characters or U+FFFD merge some).
    assert 1 <= len(out) <= 20
    assert model.training
    model.eval()
    generate(model, "", 3, temperature=0.0)
    assert not model.training


def test_generate_is_reproducible_with_a_generator_and_crops_long_prompts() -> None:
    model = tiny_model()
    prompt = "x" * (3 * TINY.block_size)  # longer than the context window
    a = generate(model, prompt, 10, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 10, generator=torch.Generator().manual_seed(1))
    assert a == b
    assert generate(model, "abc", 0) == ""


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 1000}, "top_k"),
    ],
)
def test_generate_rejects_bad_arguments_naming_them(kwargs: dict, name: str) -> None:
    args = {"max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=name):
        generate(tiny_model(), "x", **args)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.eval_fraction=0.9", "data.eval_fraction"),
        ("data.eval_fraction=0", "data.eval_fraction"),
        ("data.max_bytes=0", "data.max_bytes"),
        ("data.batch_size=0", "data.batch_size"),
        ("model.n_head=3", "model.n_embd"),
        ("model.n_layer=0", "model.n_layer"),
        ("model.block_size=0", "model.block_size"),
        ("model.dropout=1.5", "model.dropout"),
    ],
)
def test_invalid_config_values_raise_naming_the_key(override: str, key: str) -> None:
    cfg = gpt.default_config()
    apply_overrides(cfg, [override])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cfg.validate()


def test_default_config_is_valid_and_registered() -> None:
    from hookloop.recipes import _RECIPES

    cfg = gpt.default_config()
    assert isinstance(cfg, Config)
    assert cfg.validate() is cfg
    assert isinstance(cfg.model, GPTConfig) and isinstance(cfg.data, TextDataConfig)
    assert cfg.train.max_steps and cfg.train.eval_every and cfg.train.eval_max_batches
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.scheduler.name == "cosine" and cfg.scheduler.warmup_steps > 0
    recipe = _RECIPES["gpt-stdlib"]
    assert recipe.build is gpt.build and recipe.default_config is gpt.default_config


def test_build_returns_model_and_map_style_datasets(tmp_path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_bytes(b"print('hello, world')\n" * 200)
    cfg = gpt.default_config()
    apply_overrides(cfg, [f"data.source={src}", "data.eval_fraction=0.25", *_tiny_overrides()])
    parts = gpt.build(cfg.validate())
    assert isinstance(parts, RecipeParts)
    assert isinstance(parts.model, GPT)
    assert isinstance(parts.train_data, ByteWindows) and isinstance(parts.eval_data, ByteWindows)
    assert len(parts.train_data) > len(parts.eval_data) > 0
    assert parts.forward_step is gpt.lm_step  # one name per metric: no "lm loss" beside "loss"
    assert parts.flops_per_sample == flops_per_sample(cfg.model, parts.model.num_params())


def test_build_explains_a_corpus_too_small_for_one_window(tmp_path) -> None:
    src = tmp_path / "tiny.txt"
    src.write_bytes(b"x = 1\n" * 5)
    cfg = gpt.default_config()
    apply_overrides(cfg, [f"data.source={src}", *_tiny_overrides()])
    with pytest.raises(ValueError, match="block_size"):
        gpt.build(cfg.validate())


def _tiny_overrides() -> list[str]:
    return [f"model.{f.name}={getattr(TINY, f.name)}" for f in dataclasses.fields(TINY)]
