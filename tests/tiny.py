"""A table of tiny causal LMs built from config objects, covering the layer families we claim."""

from __future__ import annotations

import socket

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def _llama(tied=True, vocab=64):
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
                                        eos_token_id=1, bos_token_id=None, pad_token_id=1))


def _qwen2():  # q/k/v projections with bias, untied head
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                        eos_token_id=1, bos_token_id=None, pad_token_id=1))


def _gpt2():  # LayerNorm, Conv1D with biases, learned positions, tied head
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                      bos_token_id=1, eos_token_id=1, pad_token_id=1))


class Gate(nn.Module):
    """A module no rule knows: its parameter must go to the exact per-sample fallback."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.tanh(self.scale)


def _llama_with_unknown_module():
    model = _llama(tied=True)
    mlp = model.model.layers[0].mlp
    down = mlp.down_proj
    mlp.down_proj = nn.Sequential(Gate(down.in_features), down)
    return model


class TwiceLM(nn.Module):
    """A causal LM whose middle Linear runs twice per forward (weight sharing across depth):
    its per-sample gradient is the sum of both calls' parts before squaring."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab})()
        self.embed = nn.Embedding(vocab, d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).float()[..., None]
        h = self.embed(input_ids) * mask  # (B, T, d); padding contributes nothing
        h = torch.tanh(self.shared(h)) * mask  # keep padding out of the causal mix
        h = h.cumsum(1) / mask.cumsum(1).clamp_min(1)  # causal mixing over real tokens
        h = torch.tanh(self.shared(h)) + h
        return type("Out", (), {"logits": self.head(h)})()


TINY_MODELS = {
    "llama-tied": lambda: _llama(tied=True),
    "llama-untied": lambda: _llama(tied=False),
    "qwen2-bias": _qwen2,
    "gpt2": _gpt2,
    "llama-fallback": _llama_with_unknown_module,
    "linear-called-twice": TwiceLM,
}


def tiny_model(name: str, seed: int = 0, noise: float = 0.1):
    """A tiny model in eval mode, with weights perturbed so no gradient is trivially zero."""
    torch.manual_seed(seed)
    model = TINY_MODELS[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


def random_batch(batch=4, length=10, vocab=64, seed=0, pad_rows=((1, 3), (2, 1))):
    """(ids, attention_mask, response_mask, signal) with some left-padded rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    attn = torch.ones(batch, length, dtype=torch.long)
    for row, pad in pad_rows:
        attn[row, :pad] = 0
        ids[row, :pad] = 1
    resp = torch.zeros(batch, length, dtype=torch.bool)
    resp[:, length // 2 + 1 :] = True
    resp[-1, -1] = False  # a row with a shorter response
    signal = torch.randn(batch, generator=g)
    return ids, attn, resp, signal


class TinyTokenizer:
    """Whitespace-separated integer ids: "2 3" <-> [2, 3]. Enough for calibrate() on tiny models."""

    chat_template = None

    def __init__(self, vocab: int, eos: int = 1):
        self.vocab, self.eos_token_id, self.pad_token_id = vocab, eos, eos
        self.eos_token = str(eos)

    def __call__(self, text: str):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == self.eos_token_id))

    def get_vocab(self):
        return {str(i): i for i in range(self.vocab)}


def enumeration_model(seed: int = 0, vocab: int = 5):
    """A tiny Llama with a 5-token vocabulary (EOS = 1) whose responses can all be enumerated."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                         eos_token_id=1, bos_token_id=None, pad_token_id=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def run_command(argv):
    """Run one CLI command's handler directly, so FisherSelectError propagates to pytest.raises."""
    from fisher_select.cli import build_parser

    args = build_parser(argv).parse_args(argv)
    return args.func(args)


def save_small_llama(path, tokenizer, hidden=64, intermediate=128, layers=2):
    """A small random Llama with a real tokenizer, saved as a model directory (for load_model / CLI)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    """A free local TCP port for a gloo process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
