"""Tools built on the whole stack (they import models): ``xhal-align``."""
