"""Text handling shared by the server, the CLI and the engine: tokenizers, incremental UTF-8-safe detokenization,
stop strings with hold-back, and chat templates.  Nothing here touches a device."""
from pegainfer.text.chat import ChatTemplate
from pegainfer.text.detokenizer import IncrementalDetokenizer
from pegainfer.text.stop import StopStringMatcher
from pegainfer.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopStringMatcher", "Tokenizer"]
