"""The sandbox API of one host: SandboxService (service.py) in process, over HTTP (server.py), and its clients (client.py)."""
