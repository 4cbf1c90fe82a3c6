"""The real ``Engine`` over ``tiny_model.TinyHistoryModel`` (logits: a hash of the sequence's history, as good as
random weights for a grammar and cheap in the simulator), with the demo model's tokenizer and chat template: for
tests of structured output through the engine and the server."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pegainfer.kernels.policy import DEFAULT_POLICY
from tests.engine.tiny_model import TinyHistoryModel


class HashModel(TinyHistoryModel):
    policy = DEFAULT_POLICY     # the launch policy the runner reads (head_argmax: the model never takes it)


def hash_engine(max_batch=8, max_model_len=192, prefix_caching=False):
    """The real Engine over the hash model, with the demo model's tokenizer and chat template (EOS <|im_end|>)."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.engine.engine import PAGE_SIZE, Engine
    from pegainfer.text.chat import ChatTemplate
    from pegainfer.text.tokenizer import Tokenizer

    folder = Path(ensure_demo_model())
    tokenizer = Tokenizer.from_folder(folder)
    eos = [tokenizer.token_to_id("<|im_end|>")]
    model = HashModel(512, max_tokens=64, max_rows=max_batch)
    pages = max_batch * -(-max_model_len // PAGE_SIZE)
    model.allocate(pages, PAGE_SIZE)
    cfg = SimpleNamespace(raw={}, eos_token_ids=eos, max_position_embeddings=max_model_len)
    return Engine(folder, model, cfg, SimpleNamespace(eos_token_ids=eos), tokenizer, ChatTemplate.from_folder(folder),
                  max_model_len, max_batch, 64, pages, use_cuda_graph=False, async_scheduling=True,
                  prefix_caching=prefix_caching)
