"""bloombee-api's Prometheus metrics (prometheus_client), served on --metrics-port when an operator asks."""

import time

from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from bloombee.api.scheduler import Scheduler

SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ApiMetrics:
    """Requests by path and status with their latency, requests queued, sessions open, tokens generated."""

    def __init__(self, scheduler: Scheduler):
        self.registry = CollectorRegistry()
        Gauge("bloombee_api_sessions_open", "swarm inference sessions running batches of requests",
              registry=self.registry).set_function(lambda: len(scheduler.active))
        Gauge("bloombee_api_requests_queued", "requests waiting for a session",
              registry=self.registry).set_function(lambda: len(scheduler.waiting))
        self.requests = Counter("bloombee_api_requests", "HTTP requests answered, by route and status code",
                                ["path", "status"], registry=self.registry)
        self.seconds = Histogram("bloombee_api_request_seconds", "seconds until a response starts (a whole answer, "
                                 "or a stream's first event)", ["path"], buckets=SECONDS_BUCKETS, registry=self.registry)
        self.completion_tokens = Counter("bloombee_api_completion_tokens", "tokens generated for requests",
                                         registry=self.registry)

    def instrument(self, app: FastAPI) -> None:
        """Count and time every request `app` answers, by its route's path."""

        @app.middleware("http")
        async def measure(request: Request, call_next):
            began = time.perf_counter()
            response = await call_next(request)
            route = request.scope.get("route")
            path = getattr(route, "path", "unrouted")
            self.requests.labels(path, str(response.status_code)).inc()
            self.seconds.labels(path).observe(time.perf_counter() - began)
            return response

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
