"""PyTorch's intra-op threads while a small model decodes on the CPU (offload/threads.py)."""

import pytest
import torch

from pdflash.draft import speculative_on_runtime
from pdflash.draft.offloaded import load_runtime_draft
from pdflash.offload.generate import generate
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.threads import SMALL_HIDDEN, decode_threads, intra_op_threads


def test_one_thread_only_for_a_small_model_on_the_cpu():
    assert decode_threads("cpu", 192) == 1
    assert decode_threads(torch.device("cpu"), SMALL_HIDDEN - 1) == 1
    assert decode_threads("cpu", SMALL_HIDDEN) is None  # gpt-oss (2880) keeps PyTorch's setting
    assert decode_threads("cuda", 192) is None


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_intra_op_threads_restores_the_count_even_after_an_error(two_threads):
    with intra_op_threads(None):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError):
        with intra_op_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


@pytest.fixture
def pair(tiny_pair):
    return tiny_pair  # conftest.py: a tiny target and its draft


def test_decode_loops_run_on_one_thread_and_restore_it(pair, two_threads):
    seen = []
    with OffloadedModel.load(pair / "target", device="cpu", expert_cache_experts=12) as rt:
        plain = generate(rt, [3, 17, 41, 5], max_new_tokens=6, eos_token_ids=[],
                         on_step=lambda info: seen.append(torch.get_num_threads()))
        assert torch.get_num_threads() == 2
        draft = load_runtime_draft(rt, pair / "draft")
        rt.reset_cache()
        spec = speculative_on_runtime(rt, draft, [3, 17, 41, 5], 6, block_size=3, eos_token_ids=[],
                                      on_step=lambda info: seen.append(torch.get_num_threads()))
        assert torch.get_num_threads() == 2
    assert seen and set(seen) == {1}
    assert spec.token_ids == plain.token_ids  # lossless either way
