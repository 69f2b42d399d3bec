"""Signed, durable webhooks (Standard Webhooks): job record transitions become deliveries on the
WEBHOOKS stream (notifier.py), which are POSTed (post_attempt.py), retried with backoff and
recorded (sender.py). service.py starts and stops both; see their docstrings for the design."""
