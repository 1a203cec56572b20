"""KV transfer between workers: handles (``handle``), leases (``leases``), the exporter and
importer around a transport (``endpoints``), and the transports (``registry`` names them;
``ucx``, ``grpc_transport``, ``local``). Import from the modules: this package's import loads
nothing (no torch for code that only needs the names)."""
