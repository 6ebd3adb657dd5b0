"""transformers' own GptOssForCausalLM as the independent reference of the tests.

Loaded with the checkpoint family's ``reference_load_kwargs()`` (what the benchmarks' reference
uses too): for MXFP4, ``Mxfp4Config(dequantize=True)``, so transformers dequantizes the experts
with its own converter. Without it, transformers >= 5.25 with the ``kernels`` package installed
keeps the experts quantized and fetches its MXFP4 kernels from the Hugging Face Hub, which an
offline machine cannot reach."""


def gpt_oss_reference(path, dtype, **kwargs):
    from transformers import GptOssForCausalLM

    from pdflash.offload.checkpoint import Checkpoint

    with Checkpoint(path) as ck:
        load = ck.family.reference_load_kwargs()
    return GptOssForCausalLM.from_pretrained(path, dtype=dtype, **load, **kwargs)
