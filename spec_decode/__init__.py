"""(planned: see the open issues)"""
