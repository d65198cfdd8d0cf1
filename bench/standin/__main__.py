from bench.standin.server import main

main()
