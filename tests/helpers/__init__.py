"""What tests of several layers share: forked ranks (harness.py), exact inputs and
references (cases.py), a loopback TCP relay (relay.py) and the fake step channel
(fake_channel.py). Imported as ``helpers.<module>`` (conftest.py puts tests/ on the path)."""
