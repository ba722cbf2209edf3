"""Averaging at a thousand peers in one process: Moshpit's grid groups and their failures
(:mod:`.moshpit`), on the project's own grid code; ``bench/scale.py`` runs it beside the DHT
simulation of :mod:`p2p.sim`."""
