"""Flat rows and the bits digest of a list of tensors (how fault-tolerant replicas compare their θ)."""

import torch

from adloco.algorithms.flat import bits_digest, flatten, unflatten


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=generator),
        torch.randn(5, dtype=torch.float64, generator=generator),
        torch.randn(6, generator=generator).bfloat16(),
    ]


def test_flatten_and_unflatten_give_the_tensors_back():
    tensors = _tensors()[:1] + [torch.randn(7)]
    assert all(torch.equal(a, b) for a, b in zip(unflatten(flatten(tensors), tensors), tensors, strict=True))


def test_the_digest_is_equal_for_equal_bits_and_tells_any_changed_element_apart():
    tensors = _tensors()
    assert bits_digest(tensors) == bits_digest([t.clone() for t in tensors])
    assert bits_digest(tensors) == bits_digest([t.t().contiguous().t() if t.dim() == 2 else t for t in tensors])
    for index in range(len(tensors)):
        changed = [t.clone() for t in tensors]
        words = {2: torch.int16, 4: torch.int32, 8: torch.int64}[changed[index].element_size()]
        changed[index].view(words).view(-1)[1] += 1  # the next float: one bit of one element
        assert not torch.equal(changed[index], tensors[index])
        assert bits_digest(changed) != bits_digest(tensors), index
    negative_zero = [torch.tensor([-0.0])]
    assert bits_digest(negative_zero) != bits_digest([torch.tensor([0.0])])  # bits, not values
    assert bits_digest(tensors[::-1]) != bits_digest(tensors)  # in order
