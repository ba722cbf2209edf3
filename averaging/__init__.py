"""Decentralized averaging: DHT group formation, butterfly all-reduce, load balancing.

May import :mod:`p2p` and :mod:`nat`; arrives with its own issue.
"""
