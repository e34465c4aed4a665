"""A model's parameters without its folder's safetensors: allocated empty (the 4-bit path writes or releases every
one of them from the GGUF's blocks), or read from the GGUF itself, tensor by tensor in the dtype asked for, where the
folder was prepared without weights (a file over gguf_convert.FOLDER_WEIGHTS_MAX_BYTES in float32)."""
import logging

import torch
from torch import nn

from ..gguf_convert import hf_tensors
from ..gguf_file import hyperparameters, read_gguf
from ..model_store import gguf_source, holds_weights

logger = logging.getLogger(__name__)


def load_model(model_path: str, dtype: torch.dtype) -> nn.Module:
    """The folder's model in `dtype`: `from_pretrained`, or for a GGUF's folder without weights, every parameter
    dequantized from the file (gguf-py's numbers, as a folder with weights holds them) and cast, one at a time."""
    if holds_weights(model_path):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    gguf = gguf_source(model_path)
    if gguf is None:
        raise FileNotFoundError(f"{model_path} holds no weights and the GGUF it was prepared from has changed")
    model = empty_model(model_path, dtype)
    give_file_weights(model, gguf)
    return model


@torch.no_grad()
def give_file_weights(model: nn.Module, gguf_path: str) -> None:
    gguf = read_gguf(gguf_path)
    parameters, written = dict(model.named_parameters()), set()
    for name, values in hf_tensors(gguf, hyperparameters(gguf)):
        parameter = parameters.get(name)
        if parameter is None or tuple(parameter.shape) != values.shape:
            raise ValueError(f"{gguf_path}: {name} of shape {values.shape} is not a parameter of the model")
        parameter.copy_(torch.from_numpy(values))
        written.add(name)
    unwritten = sorted(set(parameters) - written)
    if unwritten:
        raise ValueError(f"{gguf_path} gives no values for {', '.join(unwritten[:3])}")
    logger.info("%d weights read from %s into %s", len(written), gguf_path, model.dtype)


def empty_model(model_path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model's architecture in `dtype`, its parameters allocated but never written, so not yet resident (the
    caller writes every one of them, or releases it: on the 4-bit path loading the safetensors first only held the
    embedded model's 540 MB float32 copy at start for nothing). Buffers (the rotary angles) are computed as
    `from_pretrained` computes them, and weights are tied as it ties them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
    allocated: dict[int, nn.Parameter] = {}  # a tied parameter is one object under two names
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if id(parameter) not in allocated:
                allocated[id(parameter)] = nn.Parameter(torch.empty(parameter.shape, dtype=dtype),
                                                        requires_grad=False)
            setattr(module, name, allocated[id(parameter)])
    model.tie_weights()  # as from_pretrained leaves it (an lm_head tied to the embedding is one tensor)
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # none shipped: from_config's, made from the model's config
        pass
    return model.eval()
