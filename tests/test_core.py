"""The core against torch.nn: outputs and gradients in float64, and mask properties."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from classify.core import (
    DROPOUT_LEVELS,
    FP32_TRAINING_KEYS,
    Decoder,
    Dropout,
    DecoderBlock,
    Embedding,
    Encoder,
    EncoderBlock,
    KVCache,
    MultiHeadAttention,
    RotaryEmbedding,
    _sdpa,
    causal_mask,
    combine_masks,
    dropout,
    padding_mask,
)

D, H, FF = 16, 4, 32
TOL = dict(rtol=1e-10, atol=1e-10)


# The same attention and masks serve every device: each test runs on the CPU and, where the machine has one,
# on the GPU (CUDA's SDPA picks its own kernels, and float64 must still match torch.nn there).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, params=DEVICES)
def float64(request):
    if request.param != "cpu" and request.node.get_closest_marker("cpu_path"):
        pytest.skip("checks a code path that only a CPU takes")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    with torch.device(request.param):
        yield
    torch.set_default_dtype(torch.float32)


def copy_mha(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ours.in_proj.weight.copy_(theirs.in_proj_weight)
        ours.in_proj.bias.copy_(theirs.in_proj_bias)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


def copy_ff_norms(ff, residual_norms, theirs) -> None:
    with torch.no_grad():
        ff.linear1.load_state_dict(theirs.linear1.state_dict())
        ff.linear2.load_state_dict(theirs.linear2.state_dict())
        for ours_norm, name in residual_norms:
            ours_norm.load_state_dict(getattr(theirs, name).state_dict())


def copy_encoder_layer(ours: EncoderBlock, theirs: nn.TransformerEncoderLayer) -> None:
    copy_mha(ours.self_attn, theirs.self_attn)
    copy_ff_norms(ours.feed_forward, [(ours.attn_residual.norm, "norm1"), (ours.ff_residual.norm, "norm2")], theirs)


def copy_decoder_layer(ours: DecoderBlock, theirs: nn.TransformerDecoderLayer) -> None:
    copy_mha(ours.self_attn, theirs.self_attn)
    copy_mha(ours.cross_attn, theirs.multihead_attn)
    copy_ff_norms(
        ours.feed_forward,
        [(ours.self_residual.norm, "norm1"), (ours.cross_residual.norm, "norm2"), (ours.ff_residual.norm, "norm3")],
        theirs,
    )


def assert_same_grads(ours: nn.Module, theirs: nn.Module, pairs: list[tuple[str, str]]) -> None:
    ours_p, theirs_p = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for a, b in pairs:
        torch.testing.assert_close(ours_p[a].grad, theirs_p[b].grad, **TOL)


def lengths_to_tokens(lengths: list[int], pad_id: int = 0) -> torch.Tensor:
    t = max(lengths)
    tokens = torch.randint(1, 50, (len(lengths), t))
    for i, n in enumerate(lengths):
        tokens[i, n:] = pad_id
    return tokens


# ------------------------------------------------------------------------ attention
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("masking", ["none", "padding", "causal", "both"])
def test_attention_matches_torch_multihead_attention(need_weights, masking):
    ours, theirs = MultiHeadAttention(D, H), nn.MultiheadAttention(D, H, batch_first=True)
    copy_mha(ours, theirs)
    x = torch.randn(3, 5, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    tokens = lengths_to_tokens([5, 3, 1])
    pad = padding_mask(tokens, 0) if masking in ("padding", "both") else None
    causal = causal_mask(5) if masking in ("causal", "both") else None
    mask = combine_masks(pad, causal)

    out, weights = ours(x, x, x, mask=mask, need_weights=need_weights)
    ref, ref_weights = theirs(
        x2, x2, x2,
        key_padding_mask=None if pad is None else ~pad[:, 0, 0],  # torch: True = ignore
        attn_mask=None if causal is None else ~causal[0, 0],
        need_weights=need_weights, average_attn_weights=True,
    )
    torch.testing.assert_close(out, ref, **TOL)
    if need_weights:
        torch.testing.assert_close(weights.mean(dim=1), ref_weights, **TOL)
    (out.square().sum()).backward()
    (ref.square().sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    assert_same_grads(ours, theirs, [("in_proj.weight", "in_proj_weight"), ("in_proj.bias", "in_proj_bias"),
                                     ("out_proj.weight", "out_proj.weight")])


def test_cross_attention_matches_torch():
    ours, theirs = MultiHeadAttention(D, H), nn.MultiheadAttention(D, H, batch_first=True)
    copy_mha(ours, theirs)
    q, kv = torch.randn(2, 4, D), torch.randn(2, 7, D)
    tokens = lengths_to_tokens([7, 2])
    out, _ = ours(q, kv, kv, mask=padding_mask(tokens, 0))
    ref, _ = theirs(q, kv, kv, key_padding_mask=tokens == 0)
    torch.testing.assert_close(out, ref, **TOL)


def test_masked_keys_get_exactly_zero_weight():
    attn = MultiHeadAttention(D, H)
    tokens = lengths_to_tokens([6, 4, 2])
    x = torch.randn(3, 6, D)
    mask = combine_masks(padding_mask(tokens, 0), causal_mask(6))
    _, weights = attn(x, x, x, mask=mask, need_weights=True)
    assert weights.shape == (3, H, 6, 6)
    blocked = ~mask.expand_as(weights)
    assert torch.all(weights[blocked] == 0.0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, H, 6))


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_row_gives_zeros_not_nan(need_weights):
    attn = MultiHeadAttention(D, H)
    x = torch.randn(2, 3, D)
    mask = torch.tensor([[True, True, True], [False, False, False]])[:, None, None, :]
    out, weights = attn(x, x, x, mask=mask, need_weights=need_weights)
    assert not torch.isnan(out).any()
    # zero attention output -> the projection's bias only
    torch.testing.assert_close(out[1], attn.out_proj.bias.expand(3, D))
    if need_weights:
        assert torch.all(weights[1] == 0)


def test_sdpa_and_explicit_paths_agree_with_dropout_off():
    attn = MultiHeadAttention(D, H, dropout=0.5).eval()
    x = torch.randn(2, 5, D)
    mask = padding_mask(lengths_to_tokens([5, 2]), 0)
    fast, _ = attn(x, x, x, mask)
    slow, _ = attn(x, x, x, mask, need_weights=True)
    torch.testing.assert_close(fast, slow, **TOL)


def test_attention_dropout_only_in_training():
    attn = MultiHeadAttention(D, H, dropout=0.5)
    x = torch.randn(2, 5, D)
    attn.train()
    assert not torch.allclose(attn(x, x, x)[0], attn(x, x, x)[0])
    attn.eval()
    torch.testing.assert_close(attn(x, x, x)[0], attn(x, x, x)[0])


@pytest.mark.cpu_path
def test_cpu_bf16_attention_that_autograd_records_on_short_texts_runs_in_fp32():
    # PyTorch's bf16 SDPA backward is the slow one on a CPU for short texts: there training computes bf16
    # attention in fp32, rounds its output back to bf16 and gets bf16 gradients. Longer texts, and inference at any
    # length, keep the bf16 kernel.
    g = torch.Generator().manual_seed(0)
    for length in (40, FP32_TRAINING_KEYS, FP32_TRAINING_KEYS + 1, 300):
        q, k, v = (torch.randn(3, H, length, 8, generator=g).bfloat16().requires_grad_() for _ in range(3))
        mask = padding_mask(lengths_to_tokens([length, length // 2, 7]), 0)
        out = _sdpa(q, k, v, mask, 0.0)
        fp32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16()
        bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert not torch.equal(fp32, bf16)  # the two kernels round differently, so the check below can fail
        assert out.dtype == torch.bfloat16 and torch.equal(out, fp32 if length <= FP32_TRAINING_KEYS else bf16)
        out.float().square().sum().backward()
        reference = [x.detach().float().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*reference, attn_mask=mask).square().sum().backward()
        for x, ref in zip((q, k, v), reference):
            assert x.grad.dtype == torch.bfloat16
            torch.testing.assert_close(x.grad.float(), ref.grad, rtol=0.05, atol=0.05)
        with torch.no_grad():
            assert torch.equal(_sdpa(q, k, v, mask, 0.0), bf16)


def kept_scale(p: float) -> float:
    """What dropout scales the kept elements by on the default device: 1 / (1 - p), with p rounded to a multiple of
    1 / DROPOUT_LEVELS on a CPU (our kernel) and kept as it is elsewhere (PyTorch's)."""
    if torch.get_default_device().type == "cpu":
        p = round(p * DROPOUT_LEVELS) / DROPOUT_LEVELS
    return 1 / (1 - p)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dropout_drops_at_its_rate_and_keeps_the_expectation(p, dtype):
    x = torch.ones(64, 8, 250, dtype=dtype)  # 128,000 elements: a multiple of 4 and not of 64
    out = dropout(x, p)
    dropped = out == 0
    assert out.dtype == dtype and out.shape == x.shape
    # every element kept is scaled by exactly 1 / (1 - the p applied): the expected output is x
    torch.testing.assert_close(out[~dropped], torch.full_like(out[~dropped], kept_scale(p)))
    sd = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(dropped.double().mean().item() - p) < 5 * sd
    # each element's 16 bits are its own: every lane of the 64-bit draws drops at the rate (the top lane too, which
    # a plain random_() would leave non-negative, so that it never dropped)
    for lane in range(4):
        assert abs(dropped.flatten()[lane::4].double().mean().item() - p) < 10 * sd
    # a second call draws a new mask
    assert not torch.equal(dropped, dropout(x, p) == 0)


def test_dropout_gradient_is_the_mask_scaled():
    x = torch.randn(4, 7, 9, requires_grad=True)
    out = dropout(x, 0.3)
    out.backward(torch.ones_like(out))
    kept = out != 0
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], kept_scale(0.3)))
    assert torch.all(x.grad[~kept] == 0)


def test_dropout_is_the_identity_outside_training_and_repeats_under_a_seed():
    x = torch.randn(3, 5)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.all(dropout(x, 1.0) == 0)
    layer = Dropout(0.5)
    assert torch.equal(layer.eval()(x), x)
    layer.train()
    torch.manual_seed(3)
    first = layer(x)
    torch.manual_seed(3)
    torch.testing.assert_close(layer(x), first, rtol=0, atol=0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        Dropout(1.5)
    for p in (-0.1, 1.5):  # the function checks too, in training or not, rather than drop everything
        with pytest.raises(ValueError, match="between 0 and 1"):
            dropout(x, p, training=False)


def test_rotary_positions_are_complex_rotations_by_position():
    """A peer formulation: each feature pair (i, i + Dh/2) as a complex number, times exp(1j * position * f_i)."""
    rotary = RotaryEmbedding(head_dim=8, max_len=40)
    x = torch.randn(2, 10, 3, 8)                                         # (B, T, H, Dh)
    frequencies = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.arange(5, 15, dtype=torch.float64)[:, None, None] * frequencies   # (T, 1, Dh/2)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(rotary(x, offset=5), torch.cat([z.real, z.imag], dim=-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(head_dim=7, max_len=4)


def test_rotary_attention_sees_distances_not_places():
    """q . k after rotation depends on the two positions only through their difference: a text attends alike
    wherever it starts."""
    rotary = RotaryEmbedding(head_dim=8, max_len=64)
    q, k = torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)                  # (B, T, H, Dh)

    def scores(q, k):
        return q.transpose(1, 2) @ k.transpose(1, 2).transpose(-2, -1)       # (B, H, T, T)

    at = [scores(rotary(q, offset), rotary(k, offset)) for offset in (0, 17, 50)]
    torch.testing.assert_close(at[1], at[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(at[2], at[0], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(at[0], scores(q, k))


def test_end_positions_count_from_the_last_real_token():
    """"end+rotary" adds positions[distance to the last real token]: the closing word of a 3-token and of a
    5-token text get the same vector, and padding changes no real token's."""
    embed = Embedding(20, 8, max_len=10, dropout=0.0, positional="end+rotary", padding_idx=0)
    tokens = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])                          # (B, T), right-padded
    added = embed(tokens) - embed.tokens(tokens)                                        # (B, T, D)
    torch.testing.assert_close(added[0, :3], embed.positions[[2, 1, 0]])
    torch.testing.assert_close(added[1], embed.positions[[4, 3, 2, 1, 0]])
    torch.testing.assert_close(embed(tokens[:1, :3]), embed(tokens)[:1, :3])
    with pytest.raises(ValueError, match="whole text"):
        embed(tokens, offset=2)
    with pytest.raises(ValueError, match="padding_idx"):
        Embedding(20, 8, max_len=10, positional="end+rotary")


@pytest.mark.parametrize("rotary", [False, True])
def test_incremental_cache_matches_full_self_attention(rotary):
    attn = MultiHeadAttention(D, H, rotary=RotaryEmbedding(D // H, 16) if rotary else None)
    x = torch.randn(2, 6, D)
    full, _ = attn(x, x, x, mask=causal_mask(6))
    cache = KVCache()
    steps = [attn(x[:, i : i + 1], x[:, i : i + 1], x[:, i : i + 1], mask=causal_mask(1, offset=i), cache=cache)[0]
             for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)


def test_masks_shapes_and_convention():
    tokens = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert padding_mask(tokens, 0).shape == (2, 1, 1, 3)
    assert padding_mask(tokens, 0)[1, 0, 0].tolist() == [True, False, False]
    assert causal_mask(3)[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert causal_mask(1, offset=2)[0, 0].tolist() == [[True, True, True]]
    assert combine_masks(None, None) is None
    assert combine_masks(padding_mask(tokens, 0), causal_mask(3)).shape == (2, 1, 3, 3)


# --------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_stack_matches_torch(norm_first, activation):
    layers = 2
    ours = Encoder(layers, D, H, FF, dropout=0.0, activation=activation, norm_first=norm_first)
    layer = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation, batch_first=True,
                                       norm_first=norm_first)
    theirs = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(D) if norm_first else None,
                                   enable_nested_tensor=False)
    for a, b in zip(ours.layers, theirs.layers):
        copy_encoder_layer(a, b)
    if norm_first:
        ours.norm.load_state_dict(theirs.norm.state_dict())
    tokens = lengths_to_tokens([6, 4, 1])
    x = torch.randn(3, 6, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out = ours(x, padding_mask(tokens, 0))
    ref = theirs(x2, src_key_padding_mask=tokens == 0)
    real = tokens != 0
    torch.testing.assert_close(out[real], ref[real], **TOL)
    out[real].sum().backward()
    ref[real].sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    assert_same_grads(ours, theirs, [("layers.0.self_attn.in_proj.weight", "layers.0.self_attn.in_proj_weight"),
                                     ("layers.1.feed_forward.linear1.weight", "layers.1.linear1.weight")])


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_stack_matches_torch(norm_first):
    layers = 2
    ours = Decoder(layers, D, H, FF, dropout=0.0, norm_first=norm_first)
    layer = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    theirs = nn.TransformerDecoder(layer, layers, norm=nn.LayerNorm(D) if norm_first else None)
    for a, b in zip(ours.layers, theirs.layers):
        copy_decoder_layer(a, b)
    if norm_first:
        ours.norm.load_state_dict(theirs.norm.state_dict())
    src = lengths_to_tokens([7, 3])
    memory = torch.randn(2, 7, D, requires_grad=True)
    memory2 = memory.detach().clone().requires_grad_(True)
    x = torch.randn(2, 5, D)
    out = ours(x, memory, causal_mask(5), padding_mask(src, 0))
    ref = theirs(x, memory2, tgt_mask=~causal_mask(5)[0, 0], memory_key_padding_mask=src == 0)
    torch.testing.assert_close(out, ref, **TOL)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(memory.grad, memory2.grad, **TOL)
    assert_same_grads(ours, theirs, [("layers.0.cross_attn.in_proj.weight", "layers.0.multihead_attn.in_proj_weight"),
                                     ("layers.1.self_attn.out_proj.weight", "layers.1.self_attn.out_proj.weight")])
