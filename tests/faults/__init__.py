"""Fault injection: a TCP fault relay, a randomized Jepsen-style campaign and its checker."""
