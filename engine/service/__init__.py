"""The engine on its socket: the ZeroMQ ROUTER loop that feeds ``LLMEngine`` and routes
tokens back (``engine_service.py``), who may connect (``curve_auth.py``), and the periodic
throughput log line (``throughput_log.py``)."""
