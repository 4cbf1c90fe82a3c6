"""Chat templates: a model folder's Jinja template turning ``messages`` into the prompt text the model was trained on.

The template runs the way Hugging Face's ``apply_chat_template`` runs it, so a folder renders here exactly as in
transformers:

* a sandboxed, immutable Jinja environment (templates come from the internet) with ``trim_blocks`` and
  ``lstrip_blocks`` and the ``loopcontrols`` extension (``{% break %}``);
* HF's extras: ``raise_exception(msg)``, a ``tojson`` filter that does not HTML-escape (``ensure_ascii=False``,
  optional ``indent``), ``strftime_now(fmt)``;
* the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special-token
  strings (``bos_token``, ``eos_token``, ...), and any extra keyword the caller passes (``enable_thinking=False``
  for Qwen3 arrives this way, from the request's ``chat_template_kwargs``).

Where the template lives, first found wins: ``chat_template.jinja``, ``chat_template.json`` (``{"chat_template":
...}``), then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}`` from
which ``"default"`` is taken).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Union

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pegainfer.errors import ModelFolderError, RequestError
from pegainfer.text.folder import read_chat_template_source, read_tokenizer_config, special_tokens


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.  ``render`` is safe to call from many threads (Jinja templates are reentrant)."""

    def __init__(self, source: str, special_tokens: Optional[dict[str, str]] = None,
                 origin: str = "chat_template in the model folder"):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFolderError(f"the chat template does not compile (line {e.lineno}: {e.message}): "
                                   f"fix {origin}") from None

    @property
    def writes_thinking(self) -> bool:
        """Whether the template writes ``<think>`` blocks (Qwen3, Qwen3.5): a chat answer may start with thinking."""
        return "<think>" in self.source

    @classmethod
    def from_folder(cls, folder: Union[str, Path], source: Optional[str] = None) -> Optional["ChatTemplate"]:
        """The folder's template with its special-token strings, or None when the folder has no template.
        ``source``: a template that replaces the folder's (``--chat-template``), with the folder's special tokens."""
        folder = Path(folder)
        config = read_tokenizer_config(folder)
        if source is not None:
            return cls(source, special_tokens(config), origin="the template given to --chat-template")
        source = read_chat_template_source(folder, config)
        if source is None:
            return None
        return cls(source, special_tokens(config))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[list] = None, documents: Optional[list] = None, continue_final_message: bool = False,
               **template_kwargs) -> str:
        """The prompt text for ``messages``.  ``continue_final_message``: the last message (the assistant's) left
        open -- the text ends with its content, the end of its turn cut off -- so the model continues it (as
        transformers' ``apply_chat_template`` does).  A template that rejects them raises ``RequestError`` (HTTP
        400)."""
        variables = {**self.special_tokens, **template_kwargs}
        try:
            text = self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt and not continue_final_message,
                                         **variables)
            if continue_final_message:
                final = messages[-1].get("content") or ""
                at = text.rfind(final.strip()) if final.strip() else -1
                if at < 0:
                    raise RequestError("continue_final_message: the chat template does not write the last "
                                       "message's content as given, so it cannot be continued")
                text = text[:at + len(final.strip())]
            return text
        except jinja2.exceptions.SecurityError as e:
            raise RequestError(f"the chat template refused an unsafe operation: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"the chat template rejected these messages: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            raise RequestError(f"the chat template failed on these messages ({type(e).__name__}: {e}): "
                               f"check the roles and contents") from None
