"""Errors a user can fix.  The CLI and the server print them as ONE line (no traceback).

Every message names the problem and, where there is one, the fix: "config.json in /models/x is not valid JSON
(line 3 column 5: Expecting ',' delimiter): fix or re-download the file".  Anything that is *not* a
``PegainferError`` is a bug in pegainfer and keeps its traceback.
"""
from __future__ import annotations


class PegainferError(Exception):
    """Base class of every user-facing error: ``str(err)`` is the whole one-line message."""


class ModelFolderError(PegainferError):
    """The model folder is missing, unreadable, or its config files are invalid."""


class UnsupportedModelError(PegainferError):
    """The folder holds a model whose architecture (or a feature of it) pegainfer does not implement."""


class WeightError(PegainferError):
    """The safetensors weights are missing, of the wrong shape or dtype, or the files are truncated/corrupt."""


class OutOfMemoryError(PegainferError):
    """The GPU does not have enough free memory for the weights, the KV cache or the workspace."""


class RequestError(PegainferError):
    """A bad request to the server (invalid parameters, prompt too long, ...): answered with HTTP 400."""
