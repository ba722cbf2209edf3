"""A thin collaborative torch training loop on top of :mod:`averaging` and :mod:`p2p`."""
