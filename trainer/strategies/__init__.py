"""Training strategies: local, the parameter-server step, and (later) data
and model parallel modes. Each is one readable function of named helpers."""
