"""The data plane's transports. The rest of the package imports ``base`` only."""
