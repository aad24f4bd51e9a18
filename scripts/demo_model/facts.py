"""Built-in tables the synthetic corpus draws from.

Everything the demo model "knows" comes from here, so the corpus is reproducible offline.
Cities are split into a training list and a held-out list: the evaluation asks about
held-out cities, so a correct tool call there means the model copies the argument from
the prompt instead of recalling a memorised chat.
"""

from __future__ import annotations

# country -> (capital, continent, language)
COUNTRIES: dict[str, tuple[str, str, str]] = {
    "France": ("Paris", "Europe", "French"),
    "Germany": ("Berlin", "Europe", "German"),
    "Italy": ("Rome", "Europe", "Italian"),
    "Spain": ("Madrid", "Europe", "Spanish"),
    "Portugal": ("Lisbon", "Europe", "Portuguese"),
    "Poland": ("Warsaw", "Europe", "Polish"),
    "Greece": ("Athens", "Europe", "Greek"),
    "Sweden": ("Stockholm", "Europe", "Swedish"),
    "Norway": ("Oslo", "Europe", "Norwegian"),
    "Finland": ("Helsinki", "Europe", "Finnish"),
    "Austria": ("Vienna", "Europe", "German"),
    "Ireland": ("Dublin", "Europe", "English"),
    "Japan": ("Tokyo", "Asia", "Japanese"),
    "China": ("Beijing", "Asia", "Chinese"),
    "India": ("New Delhi", "Asia", "Hindi"),
    "Thailand": ("Bangkok", "Asia", "Thai"),
    "Vietnam": ("Hanoi", "Asia", "Vietnamese"),
    "Indonesia": ("Jakarta", "Asia", "Indonesian"),
    "Egypt": ("Cairo", "Africa", "Arabic"),
    "Kenya": ("Nairobi", "Africa", "Swahili"),
    "Nigeria": ("Abuja", "Africa", "English"),
    "Morocco": ("Rabat", "Africa", "Arabic"),
    "Canada": ("Ottawa", "North America", "English"),
    "Mexico": ("Mexico City", "North America", "Spanish"),
    "Brazil": ("Brasilia", "South America", "Portuguese"),
    "Argentina": ("Buenos Aires", "South America", "Spanish"),
    "Peru": ("Lima", "South America", "Spanish"),
    "Chile": ("Santiago", "South America", "Spanish"),
    "Australia": ("Canberra", "Oceania", "English"),
    "New Zealand": ("Wellington", "Oceania", "English"),
}

# element -> (symbol, atomic number)
ELEMENTS: dict[str, tuple[str, int]] = {
    "hydrogen": ("H", 1), "helium": ("He", 2), "lithium": ("Li", 3), "carbon": ("C", 6),
    "nitrogen": ("N", 7), "oxygen": ("O", 8), "fluorine": ("F", 9), "neon": ("Ne", 10),
    "sodium": ("Na", 11), "magnesium": ("Mg", 12), "aluminium": ("Al", 13), "silicon": ("Si", 14),
    "sulfur": ("S", 16), "chlorine": ("Cl", 17), "argon": ("Ar", 18), "potassium": ("K", 19),
    "calcium": ("Ca", 20), "iron": ("Fe", 26), "copper": ("Cu", 29), "zinc": ("Zn", 30),
    "silver": ("Ag", 47), "tin": ("Sn", 50), "gold": ("Au", 79), "mercury": ("Hg", 80),
    "lead": ("Pb", 82),
}

# Cities used by the weather / time tools.  EVAL_CITIES never occur in training data.
# The tools' argument must be *copied* from the prompt, so training names many cities (the
# real ones below plus made-up names from ``synthetic_city``): with a few hundred real names,
# each seen only a handful of times, and fresh made-up names in half the chats, copying the
# name is the only way to fit the data (a short list lets a tiny model learn a prior instead).
TRAIN_CITIES: list[str] = [
    "Paris", "Berlin", "Rome", "Madrid", "Lisbon", "Warsaw", "Athens", "Stockholm", "Oslo",
    "Helsinki", "Vienna", "Dublin", "Tokyo", "Beijing", "Bangkok", "Hanoi", "Jakarta", "Cairo",
    "Nairobi", "Rabat", "Ottawa", "Lima", "Santiago", "Canberra", "Wellington", "London",
    "Amsterdam", "Brussels", "Prague", "Budapest", "Zurich", "Geneva", "Munich", "Hamburg",
    "Milan", "Naples", "Barcelona", "Seville", "Porto", "Krakow", "Copenhagen", "Reykjavik",
    "Edinburgh", "Manchester", "Lyon", "Marseille", "Toronto", "Vancouver", "Montreal",
    "Chicago", "Boston", "Seattle", "Denver", "Houston", "Miami", "Atlanta", "Phoenix",
    "Dallas", "Osaka", "Kyoto", "Seoul", "Busan", "Shanghai", "Shenzhen", "Mumbai", "Chennai",
    "Kolkata", "Dubai", "Doha", "Istanbul", "Ankara", "Tehran", "Karachi", "Lagos", "Accra",
    "Dakar", "Tunis", "Algiers", "Casablanca", "Johannesburg", "Cape Town", "Sydney",
    "Melbourne", "Perth", "Brisbane", "Auckland", "Quito", "Bogota", "Caracas", "Havana",
    # Europe
    "Bremen", "Cologne", "Dresden", "Frankfurt", "Stuttgart", "Nuremberg", "Hanover", "Dortmund",
    "Essen", "Bonn", "Heidelberg", "Freiburg", "Rotterdam", "The Hague", "Eindhoven", "Ghent",
    "Bruges", "Liege", "Luxembourg", "Basel", "Bern", "Lugano", "Innsbruck", "Graz", "Linz",
    "Brno", "Ostrava", "Bratislava", "Kosice", "Debrecen", "Szeged", "Wroclaw", "Poznan", "Lodz",
    "Lublin", "Katowice", "Kaunas", "Minsk", "Kyiv", "Lviv", "Odesa", "Kharkiv", "Chisinau",
    "Bucharest", "Cluj", "Timisoara", "Iasi", "Sofia", "Plovdiv", "Varna", "Belgrade", "Novi Sad",
    "Zagreb", "Split", "Ljubljana", "Sarajevo", "Skopje", "Tirana", "Podgorica", "Thessaloniki",
    "Patras", "Heraklion", "Nicosia", "Valletta", "Palermo", "Catania", "Turin", "Genoa",
    "Venice", "Verona", "Pisa", "Bari", "Trieste", "Cagliari", "Nice", "Toulouse", "Bordeaux",
    "Nantes", "Lille", "Strasbourg", "Rennes", "Montpellier", "Grenoble", "Dijon", "Malaga",
    "Granada", "Zaragoza", "Alicante", "Murcia", "Palma", "Cordoba", "Coimbra", "Braga", "Faro",
    "Glasgow", "Cardiff", "Belfast", "Liverpool", "Leeds", "Bristol", "Birmingham", "Newcastle",
    "Sheffield", "Oxford", "Cambridge", "Brighton", "York", "Aberdeen", "Cork", "Galway",
    "Limerick", "Aarhus", "Odense", "Malmo", "Gothenburg", "Uppsala", "Turku", "Oulu",
    "Trondheim", "Stavanger", "Tromso", "Moscow", "Kazan", "Samara", "Omsk", "Novosibirsk",
    "Irkutsk", "Murmansk", "Tbilisi", "Yerevan", "Baku",
    # Asia
    "Almaty", "Astana", "Tashkent", "Samarkand", "Bishkek", "Kabul", "Lahore", "Islamabad",
    "Peshawar", "Delhi", "Jaipur", "Agra", "Ahmedabad", "Hyderabad", "Bangalore", "Kochi",
    "Nagpur", "Indore", "Bhopal", "Patna", "Varanasi", "Amritsar", "Colombo", "Kandy",
    "Kathmandu", "Dhaka", "Chittagong", "Thimphu", "Yangon", "Mandalay", "Chiang Mai", "Phuket",
    "Vientiane", "Phnom Penh", "Ho Chi Minh City", "Hue", "Kuala Lumpur", "Penang", "Singapore",
    "Manila", "Cebu", "Davao", "Surabaya", "Bandung", "Medan", "Denpasar", "Makassar", "Taipei",
    "Kaohsiung", "Hong Kong", "Macau", "Guangzhou", "Chengdu", "Chongqing", "Wuhan", "Xian",
    "Nanjing", "Hangzhou", "Suzhou", "Tianjin", "Harbin", "Qingdao", "Kunming", "Lhasa",
    "Urumqi", "Ulaanbaatar", "Pyongyang", "Daegu", "Gwangju", "Yokohama", "Fukuoka", "Hiroshima",
    "Sendai", "Nara", "Kanazawa", "Riyadh", "Jeddah", "Mecca", "Medina", "Muscat", "Manama",
    "Kuwait City", "Abu Dhabi", "Sharjah", "Amman", "Beirut", "Damascus", "Aleppo", "Baghdad",
    "Basra", "Jerusalem", "Tel Aviv", "Haifa", "Izmir", "Antalya", "Bursa", "Isfahan", "Shiraz",
    "Tabriz", "Mashhad",
    # Africa
    "Alexandria", "Luxor", "Aswan", "Khartoum", "Addis Ababa", "Asmara", "Djibouti", "Mogadishu",
    "Kampala", "Kigali", "Bujumbura", "Dar es Salaam", "Zanzibar", "Dodoma", "Lusaka", "Harare",
    "Bulawayo", "Maputo", "Lilongwe", "Blantyre", "Gaborone", "Windhoek", "Pretoria",
    "Port Elizabeth", "Bloemfontein", "Antananarivo", "Port Louis", "Luanda", "Kinshasa",
    "Brazzaville", "Libreville", "Yaounde", "Douala", "Kano", "Ibadan", "Abidjan", "Lome",
    "Cotonou", "Ouagadougou", "Bamako", "Niamey", "Nouakchott", "Freetown", "Monrovia", "Conakry",
    "Banjul", "Fez", "Agadir", "Tripoli", "Benghazi", "Oran",
    # The Americas
    "New York", "Los Angeles", "San Francisco", "San Jose", "Philadelphia", "Washington",
    "Baltimore", "Pittsburgh", "Cleveland", "Detroit", "Minneapolis", "Milwaukee", "St Louis",
    "Kansas City", "Nashville", "Memphis", "New Orleans", "Orlando", "Tampa", "Charlotte",
    "Raleigh", "Richmond", "Salt Lake City", "Las Vegas", "Sacramento", "Albuquerque",
    "Anchorage", "Honolulu", "Indianapolis", "Columbus", "Cincinnati", "Buffalo", "Omaha",
    "Oklahoma City", "El Paso", "Quebec City", "Edmonton", "Regina", "Victoria", "Guadalajara",
    "Monterrey", "Puebla", "Tijuana", "Cancun", "Oaxaca", "Merida", "Guatemala City",
    "San Salvador", "Tegucigalpa", "Managua", "San Juan", "Kingston", "Santo Domingo", "Nassau",
    "Panama City", "Cali", "Cartagena", "Barranquilla", "Guayaquil", "Cuenca", "La Paz", "Sucre",
    "Santa Cruz", "Asuncion", "Montevideo", "Mendoza", "Salta", "Valparaiso", "Concepcion",
    "Antofagasta", "Sao Paulo", "Rio de Janeiro", "Salvador", "Recife", "Fortaleza", "Manaus",
    "Belem", "Curitiba", "Porto Alegre", "Belo Horizonte", "Brasilia", "Buenos Aires",
    "Mexico City", "New Delhi", "Georgetown", "Paramaribo",
    # Oceania
    "Suva", "Apia", "Port Moresby", "Noumea", "Christchurch", "Dunedin", "Hamilton", "Queenstown",
    "Gold Coast", "Geelong", "Townsville", "Alice Springs",
]
EVAL_CITIES: list[str] = [
    "Florence", "Valencia", "Bergen", "Gdansk", "Salzburg", "Tampere", "Nagoya", "Sapporo",
    "Pune", "Lucknow", "Cusco", "Rosario", "Calgary", "Halifax", "Portland", "Austin",
    "Adelaide", "Hobart", "Marrakesh", "Mombasa", "Bologna", "Leipzig", "Utrecht", "Antwerp",
    "Lausanne", "Bilbao", "Tallinn", "Riga", "Vilnius", "Winnipeg", "Tucson", "Darwin", "Kobe",
    "Incheon", "Surat", "Medellin", "Arequipa", "Durban", "San Diego", "Da Nang",
]

# Made-up city names (training only): syllables, sometimes a suffix or a second word.
_ONSETS = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kr", "l", "m", "n", "p",
           "pr", "r", "s", "sh", "st", "t", "tr", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ia", "ai", "ou"]
_CODAS = ["", "", "", "", "", "n", "r", "l", "s", "m", "nd", "st"]
_SUFFIXES = ["burg", "ville", "ton", "ford", "port", "stad", "grad", "polis", "heim", "dale", "mouth",
             "wick", "haven"]
_PREFIX_WORDS = ["San", "Port", "New", "Saint", "Lake", "Mount", "Fort", "El", "Santa"]
_SUFFIX_WORDS = ["City", "Bay", "Falls", "Springs", "Harbor"]


def synthetic_city(rng) -> str:
    """A made-up, pronounceable city name such as "Velmaro", "Port Shaidun" or "Krostonville"."""
    while True:
        syllables = rng.choice((2, 2, 2, 3, 3)) if rng.random() < 0.7 else rng.choice((1, 2))
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if syllables <= 2 and rng.random() < 0.35:
            name += rng.choice(_SUFFIXES)
        if len(name) >= 4:
            break
    name = name.capitalize()
    r = rng.random()
    if r < 0.08:
        name = f"{rng.choice(_PREFIX_WORDS)} {name}"
    elif r < 0.14:
        name = f"{name} {rng.choice(_SUFFIX_WORDS)}"
    return name

CONDITIONS: list[str] = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]

# Words for string tasks and search queries.  EVAL_WORDS never occur in training data.
TRAIN_WORDS: list[str] = [
    "apple", "banana", "river", "mountain", "garden", "window", "rocket", "planet", "yellow",
    "purple", "silver", "pencil", "bottle", "candle", "castle", "dragon", "forest", "guitar",
    "hammer", "island", "jacket", "kitten", "ladder", "magnet", "needle", "orange", "parrot",
    "rabbit", "saddle", "tomato", "turtle", "violin", "wallet", "zebra", "anchor", "basket",
    "cactus", "desert", "engine", "falcon", "glacier", "harbor", "igloo", "jungle", "kernel",
    "lemon", "meadow", "napkin", "oyster", "pepper", "quartz", "rubber", "spider", "ticket",
    "umbrella", "valley", "walnut", "yogurt", "bridge", "cookie", "dollar", "feather", "ginger",
    "helmet", "insect", "jigsaw", "kettle", "lizard", "mirror", "noodle", "onion", "pillow",
    "riddle", "summer", "tunnel", "velvet", "winter", "butter", "copper", "donkey", "eagle",
]
EVAL_WORDS: list[str] = [
    "lantern", "marble", "pebble", "saffron", "thimble", "walrus", "biscuit", "compass",
    "dolphin", "emerald", "fossil", "gazelle", "hazel", "iris", "juniper", "koala",
]

# Search-query topics (two-word phrases are built from these and the word lists).
TRAIN_TOPICS: list[str] = [
    "python lists", "sorting algorithms", "prime numbers", "black holes", "solar panels",
    "machine learning", "ancient rome", "coffee brewing", "chess openings", "ocean tides",
    "volcano eruptions", "bird migration", "jazz music", "electric cars", "tea ceremonies",
    "roman numerals", "binary search", "hash tables", "climate change", "vitamin c",
    "plate tectonics", "the moon landing", "bread baking", "rainbow colors", "wind turbines",
    "honey bees", "paper folding", "deep sea fish", "desert plants", "mountain climbing",
]
EVAL_TOPICS: list[str] = [
    "quantum computing", "coral reefs", "medieval castles", "sourdough starters",
    "northern lights", "glass blowing", "linked lists", "solar eclipses",
]

UNITS: dict[tuple[str, str], int] = {
    ("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60, ("liters", "ml"): 1000, ("days", "hours"): 24,
}

SMALL_TALK: list[tuple[str, str]] = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Good morning!", "Good morning! How can I help you today?"),
    ("Thank you!", "You are welcome! Let me know if you need anything else."),
    ("Thanks for the help.", "You are welcome! Let me know if you need anything else."),
    ("Who are you?", "I am a tiny demo assistant. I can answer simple questions and call tools."),
    ("What can you do?", "I can answer simple questions, do small sums and call tools such as weather and search."),
    ("Goodbye.", "Goodbye! Have a nice day."),
    ("How are you?", "I am fine, thank you. How can I help you today?"),
    ("Tell me a joke.", "Why did the computer go to the doctor? Because it had a virus."),
]
