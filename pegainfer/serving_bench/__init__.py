"""The parts of ``python -m pegainfer bench-serve`` (``pegainfer/bench_serve.py``): the requests (``workload``), the
streaming HTTP client (``client``), the figures (``metrics``), the server it starts (``launch``) and the Hugging
Face peer (``hf``)."""
