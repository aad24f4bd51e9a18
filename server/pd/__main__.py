"""``python -m server.pd --config-file conf/pd/coordinator.json``: the PD coordinator."""
import sys

from server.pd.coordinator import main

sys.exit(main())
