"""A bfloat16 head's near-ties are settled by the float32 logits of the held weights."""

from __future__ import annotations

import pytest
import torch

from swarmd.engine.linear import Dense, Int8, Matrix, make_matrix
from swarmd.engine.ties import settle_near_ties
from swarmd.model import quant


def _tied_head(fmt: str) -> tuple[Matrix, torch.Tensor, torch.Tensor]:
    """A head whose rows 0 and 1 differ in one weight by one step of its format, times
    an input of 1/64 there: their logits differ by far less than a bfloat16 step. Both
    rows lead the others by a wide margin. Returns (head, x [4, 96], its float64 weights
    [64, 96]), every number exact in bfloat16. "int8" is held as a node holds it (swarmd's
    kernel where it loaded), "int8-torch" on torch's kernel."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 96, generator=generator).abs().to(torch.bfloat16).float()
    x[:, 7] = 1 / 64
    if fmt.startswith("int8"):
        values = torch.randint(-20, 20, (64, 96), generator=generator, dtype=torch.int8)
        values[0] = 100
        values[1] = values[0]
        values[1, 7] += 1
        scale = torch.full((64,), 2.0**-6)
        stored = quant.Int8(values, scale)
        head = Int8(stored, None, torch.bfloat16) if fmt == "int8-torch" else None
        head = head or make_matrix(stored, None, torch.bfloat16)
        return head, x, values.double() * scale.double()[:, None]
    weight = (torch.randn(64, 96, generator=generator) * 0.05).to(torch.bfloat16).float()
    weight[0] = 1.0
    weight[0, 7] = 0.5
    weight[1] = weight[0]
    weight[1, 7] = 0.5 + 2.0**-8  # one bfloat16 step above 0.5
    return Dense(weight.to(torch.bfloat16), None, "bf16"), x, weight.double()


@pytest.mark.parametrize("fmt", ["int8", "int8-torch", "bf16"])
def test_a_tie_in_bfloat16_goes_to_the_token_the_weights_prefer(fmt: str) -> None:
    """Rows 0 and 1 round to one logit, and argmax took row 0 (the lower id); row 1's
    float32 logit is the higher. Settled, row 1 wins, and both are the float32 logits."""
    head, x, rows = _tied_head(fmt)
    logits = head(x.to(torch.bfloat16)).float()
    exact = (x.double() @ rows.T).float()  # in float64 first
    tied = logits[:, 0] == logits[:, 1]
    assert tied.sum() >= 2  # the setup: most rows of x tie
    assert (logits[tied].argmax(-1) == 0).all()
    assert (exact[:, 1] > exact[:, 0]).all()
    settle_near_ties(logits, x, head)
    assert (logits.argmax(-1) == 1).all()
    torch.testing.assert_close(logits[:, :2], exact[:, :2], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kernel", ["as held", "torch"])
def test_settled_logits_have_the_same_bits_in_any_batch(kernel: str) -> None:
    """A row's settled logits do not depend on the rows beside it."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(-127, 128, (512, 576), generator=generator, dtype=torch.int8)
    stored = quant.Int8(values, torch.rand(512, generator=generator) / 64)
    if kernel == "torch":
        head: Matrix = Int8(stored, None, torch.bfloat16)
    else:
        head = make_matrix(stored, None, torch.bfloat16)
    x = torch.randn(8, 576, generator=generator)
    together = head(x.to(torch.bfloat16)).float()
    settle_near_ties(together, x, head)
    for i in range(8):
        alone = head(x[i : i + 1].to(torch.bfloat16)).float()
        settle_near_ties(alone, x[i : i + 1], head)
        assert torch.equal(alone[0], together[i])


def test_a_float32_head_is_left_as_it_is() -> None:
    weight = torch.randn(32, 16)
    head = Dense(weight, None, "fp32")
    x = torch.randn(2, 16)
    logits = head(x)
    before = logits.clone()
    settle_near_ties(logits, x, head)
    assert torch.equal(logits, before)
