"""A block server's Prometheus metrics (prometheus_client), served on --metrics-port when an operator asks."""

from hivemind.proto import runtime_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from bloombee.protocol import ErrorKind, error_envelope
from bloombee.server.sessions import SessionRegistry

ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Sessions open and waiting for memory, rows and compute seconds per forward, bytes in and out per hop, cache
    bytes reserved and refusals by reason, in a registry of their own."""

    def __init__(self, sessions: SessionRegistry):
        self.registry = CollectorRegistry()
        Gauge("bloombee_server_sessions_open", "inference sessions open on this server",
              registry=self.registry).set_function(lambda: len(sessions))
        Gauge("bloombee_server_sessions_waiting", "sessions waiting for cache memory before they open",
              registry=self.registry).set_function(lambda: sessions.budget.waiting)
        cache = Gauge("bloombee_server_cache_bytes", "KV cache and history bytes reserved by open sessions",
                      ["memory"], registry=self.registry)
        cache.labels("device").set_function(lambda: sessions.budget.used.device)
        cache.labels("host").set_function(lambda: sessions.budget.used.host)
        self.rows = Histogram("bloombee_server_rows_per_forward", "hidden vectors (rows x positions of every step in "
                              "it) one forward computes", buckets=ROWS_BUCKETS, registry=self.registry)
        self.steps = Histogram("bloombee_server_steps_per_forward", "sessions' steps one forward computes together",
                               buckets=ROWS_BUCKETS, registry=self.registry)
        self.step_seconds = Histogram("bloombee_server_step_seconds", "seconds one step takes through the hosted blocks",
                                      buckets=SECONDS_BUCKETS, registry=self.registry)
        hop_bytes = Counter("bloombee_server_hop_bytes", "bytes of steps on the wire: in (from the client or the "
                            "previous server), out (to the next server or the client)", ["direction"],
                            registry=self.registry)
        self.bytes_in, self.bytes_out = hop_bytes.labels("in"), hop_bytes.labels("out")  # looked up once: every step
        self.refusals = Counter("bloombee_server_refusals", "requests and steps refused, by reason (the error kind "
                                "the client gets)", ["reason"], registry=self.registry)

    def refusal(self, kind: ErrorKind, text: str, *args) -> runtime_pb2.ExpertRequest:
        """The error reply `error_envelope(kind, text, *args)`, counted by its kind."""
        self.refusals.labels(kind.value).inc()
        return error_envelope(kind, text, *args)

    def observe_forward(self, vectors: int, steps: int) -> None:
        self.rows.observe(vectors)
        self.steps.observe(steps)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
