"""transformers' own GptOssForCausalLM as the independent reference of the tests.

MXFP4 checkpoints are loaded with ``Mxfp4Config(dequantize=True)``: transformers dequantizes the
experts with its own converter. Without it, transformers >= 5.25 with the ``kernels`` package
installed keeps the experts quantized and fetches its MXFP4 kernels from the Hugging Face Hub,
which an offline machine cannot reach."""

import json
from pathlib import Path


def gpt_oss_reference(path, dtype, **kwargs):
    from transformers import GptOssForCausalLM

    config = json.loads((Path(path) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        kwargs.setdefault("quantization_config", Mxfp4Config(dequantize=True))
    return GptOssForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
