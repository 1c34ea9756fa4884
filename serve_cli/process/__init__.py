"""The process layer between the API and the engine: the engine process's step loop
(``engine_process``), the API process's client of it (``engine_client``) and the plain messages
they exchange over ZMQ (``messages``)."""
