import sys

from openai_frontend.cli import main

sys.exit(main())
