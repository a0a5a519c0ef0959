"""Short-lived tasks push to a Pushgateway: checked against a small local HTTP stand-in of the Pushgateway."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from ddiloco.tracking.metrics import push_task_metrics


def test_push_sends_the_task_gauges_to_the_gateway():
    received = []

    class Gateway(BaseHTTPRequestHandler):  # stand-in: records what a Pushgateway would receive
        def do_PUT(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body.decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        push_task_metrics(
            f"127.0.0.1:{server.server_port}", "prepare", "r1", {"seconds": 1.5, "val_tokens": 10}
        )
    finally:
        server.shutdown()
    ((path, body),) = received
    assert path == "/metrics/job/ddiloco_prepare/run_id/r1"
    assert 'ddiloco_prepare_seconds{run_id="r1"} 1.5' in body
    assert 'ddiloco_prepare_val_tokens{run_id="r1"} 10.0' in body


def test_unreachable_gateway_does_not_fail_the_task():
    push_task_metrics("127.0.0.1:9", "prepare", "r1", {"seconds": 1.0})
    push_task_metrics(None, "prepare", "r1", {"seconds": 1.0})


def test_a_taken_metrics_port_is_logged_and_training_goes_on(caplog):
    """A port another program holds must not kill a learner (every restart would fail the same way)."""
    import socket

    from prometheus_client import CollectorRegistry

    from ddiloco.tracking.metrics import serve

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        port = holder.getsockname()[1]
        assert serve(CollectorRegistry(), port, "127.0.0.1") is None
    finally:
        holder.close()
    assert "training goes on without it" in caplog.text
