"""`asyncinfer up`: the whole stack in one process on an embedded nats-server (stack.py), with
the defaults it adds (defaults.py), the ports it checks before anything starts (ports.py) and
the banner it prints once everything serves (banner.py)."""
